"""ctypes bindings of the muond client library's C ABI (client/muond_client.h).

The library is found, in order, at $MUOND_CLIENT_LIB, in the build tree next to this source
(build/lib/libmuond_client.so of the repository), or by the dynamic loader (an installed
libmuond_client.so). Every C call that fails raises MuondError with the gRPC status code and the
message of muond_last_error(), which is per thread, so calls from several threads are safe.
"""
import ctypes
import ctypes.util
import os
import threading

# gRPC status codes (DESIGN.md section 8 lists what muond uses each one for).
CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}
CODES = {name: code for code, name in CODE_NAMES.items()}


class MuondError(RuntimeError):
    """A failed muond operation.

    code: the gRPC status code (int); code_name: its name ("INVALID_ARGUMENT", ...);
    message: what failed and where, as the daemon or the client library says it;
    operation: the call that failed (e.g. "muond_step_in_place").
    """

    def __init__(self, code, message, operation=""):
        self.code = int(code)
        self.code_name = CODE_NAMES.get(self.code, f"CODE_{self.code}")
        self.message = message
        self.operation = operation
        where = f"{operation}: " if operation else ""
        super().__init__(f"{where}{self.code_name} ({self.code}): {message}")


class ShardSpan(ctypes.Structure):
    """muond_shard_span: `length` elements of matrix `matrix` from element `offset`, stored at
    element `rank_offset` of the rank's flat buffer."""
    _fields_ = [("matrix", ctypes.c_uint32), ("offset", ctypes.c_uint64),
                ("length", ctypes.c_uint64), ("rank_offset", ctypes.c_uint64)]


class Span(ctypes.Structure):
    """muond_span: a run of a matrix's elements in the caller's memory."""
    _fields_ = [("matrix", ctypes.c_uint32), ("offset", ctypes.c_uint64),
                ("data", ctypes.c_void_p), ("length", ctypes.c_uint64)]


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_PI64 = ctypes.POINTER(ctypes.c_int64)

# name: (restype, argtypes). Functions returning int are status codes unless noted in _RAW.
_SIGNATURES = {
    "muond_last_error": (ctypes.c_char_p, []),
    "muond_layout_spans": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ShardSpan),
                                          ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                          ctypes.POINTER(ctypes.c_uint64)]),
    "muond_connect": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(_P)]),
    "muond_connect_tls": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.c_char_p, ctypes.POINTER(_P)]),
    "muond_client_free": (None, [_P]),
    "muond_health": (ctypes.c_int, [_P, ctypes.c_double]),
    "muond_job_create": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "muond_job_delete": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p]),
    "muond_job_reset": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, _I64]),
    "muond_attach": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                    ctypes.c_char_p, ctypes.POINTER(_P)]),
    "muond_session_is_shm": (ctypes.c_int, [_P]),
    "muond_session_free": (None, [_P]),
    "muond_session_next_step": (_I64, [_P]),
    "muond_session_spans": (ctypes.c_size_t, [_P, ctypes.POINTER(ShardSpan), ctypes.c_size_t]),
    "muond_session_buffer_elements": (ctypes.c_uint64, [_P]),
    "muond_step": (ctypes.c_int, [_P, _I64, ctypes.POINTER(Span), ctypes.c_size_t,
                                  ctypes.POINTER(Span), ctypes.c_size_t]),
    "muond_session_gradient_view": (ctypes.c_int, [_P, _I64, ctypes.POINTER(_P),
                                                   ctypes.POINTER(ctypes.c_size_t)]),
    "muond_session_update_view": (ctypes.c_int, [_P, _I64, ctypes.POINTER(_P),
                                                 ctypes.POINTER(ctypes.c_size_t)]),
    "muond_step_in_place": (ctypes.c_int, [_P, _I64]),
    "muond_step_post": (ctypes.c_int, [_P, _I64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int]),
    "muond_step_progress": (ctypes.c_int, [_P, _I64, ctypes.c_double,
                                           ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t,
                                           ctypes.POINTER(ctypes.c_int)]),
    "muond_step_wait": (ctypes.c_int, [_P, _I64, ctypes.POINTER(ctypes.c_int)]),
    "muond_step_buffer": (ctypes.c_int, [_P, _I64, _P, _P]),
    "muond_session_last_step_skipped": (ctypes.c_int, [_P]),
    "muond_session_last_step_sum_sq": (ctypes.c_double, [_P]),
    "muond_session_set_global_clip": (ctypes.c_int, [_P, ctypes.c_int, ctypes.c_double]),
    "muond_session_set_outside_sum_sq": (ctypes.c_int, [_P, ctypes.c_double]),
    # Checkpoints (DESIGN.md section 7).
    "muond_checkpoint_save": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, _PI64, _PI64]),
    "muond_checkpoint_load": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, _I64, _I64,
                                             _PI64, _PI64]),
    # Apply mode (DESIGN.md section 4b): a step's hyperparameters, the initial weights, the
    # layout of the parameters in the update buffer, and the master weights as a model file.
    "muond_session_set_hyper": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_char_p),
                                               ctypes.POINTER(ctypes.c_double),
                                               ctypes.POINTER(ctypes.c_double), ctypes.c_size_t,
                                               ctypes.c_double]),
    "muond_session_set_absent": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_uint32),
                                                ctypes.c_size_t]),
    "muond_session_set_max_logits": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_float),
                                                     ctypes.c_size_t]),
    "muond_init_params": (ctypes.c_int, [_P, ctypes.POINTER(Span), ctypes.c_size_t, ctypes.c_int]),
    "muond_init_params_buffer": (ctypes.c_int, [_P, _P, ctypes.c_int]),
    "muond_session_init_view": (ctypes.c_int, [_P, ctypes.POINTER(_P),
                                               ctypes.POINTER(ctypes.c_size_t)]),
    "muond_init_params_in_place": (ctypes.c_int, [_P]),
    "muond_session_param_byte_offset": (ctypes.c_int, [_P, ctypes.c_size_t,
                                                       ctypes.POINTER(ctypes.c_uint64)]),
    "muond_export": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                    ctypes.c_char_p]),
    # Many nodes (DESIGN.md 4c; multinode.py): the ownership plan, two-phase steps, checkpoints.
    "muond_ownership_plan": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int,
                                            ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                                            ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_double),
                                            ctypes.POINTER(ctypes.c_double)]),
    "muond_ownership_pieces": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int,
                                              ctypes.POINTER(ctypes.c_int32), _PI64, _PI64,
                                              ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                                              ctypes.POINTER(ctypes.c_size_t)]),
    "muond_step_commit": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, _I64]),
    "muond_step_abort": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, _I64,
                                        ctypes.c_char_p]),
    "muond_step_rollback": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, _I64,
                                           ctypes.c_char_p]),
    "muond_checkpoint_list": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, _PI64, _PI64,
                                             ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    # Re-sharding through a full-state export (muonctl checkpoint export, job create --import-dir).
    "muond_checkpoint_export": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, _I64, _I64,
                                               ctypes.c_char_p, _PI64]),
    "muond_checkpoint_export_as": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p, _I64,
                                                  _I64, ctypes.c_char_p, ctypes.c_char_p, _PI64]),
    "muond_job_create_from_export": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p,
                                                    ctypes.c_char_p, ctypes.c_size_t]),
}

_lock = threading.Lock()
_lib = None
_lib_path = None


def _candidates():
    env = os.environ.get("MUOND_CLIENT_LIB")
    if env:
        return [env], True
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.normpath(os.path.join(here, "..", "..", ".."))
    paths = [os.path.join(repo, "build", "lib", "libmuond_client.so")]
    found = ctypes.util.find_library("muond_client")
    if found:
        paths.append(found)
    return paths, False


def library_path():
    """The path of the loaded client library (loads it on first use)."""
    lib()
    return _lib_path


def lib():
    """The loaded client library with its signatures declared. Raises MuondError (UNAVAILABLE)
    naming the places searched when it cannot be found."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            return _lib
        paths, from_env = _candidates()
        errors = []
        for path in paths:
            if not from_env and os.path.sep in path and not os.path.exists(path):
                errors.append(f"{path}: no such file")
                continue
            try:
                handle = ctypes.CDLL(path)
            except OSError as e:
                errors.append(f"{path}: {e}")
                continue
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(handle, name, None)
                if fn is None:
                    continue  # an older library: require() reports it when the call is made
                fn.restype = restype
                fn.argtypes = argtypes
            _lib, _lib_path = handle, path
            return _lib
        raise MuondError(CODES["UNAVAILABLE"],
                         "cannot load libmuond_client.so (set MUOND_CLIENT_LIB or build the "
                         "muond_client_shared target into build/lib): " + "; ".join(errors),
                         "load")


def function(name):
    """The C function `name`; MuondError (UNIMPLEMENTED) when the loaded library lacks it."""
    handle = lib()
    if not hasattr(handle, name):
        raise MuondError(CODES["UNIMPLEMENTED"],
                         f"{_lib_path} has no {name}(): the library was built from a source "
                         "without it; rebuild muond_client_shared", name)
    return getattr(handle, name)


def last_error():
    raw = lib().muond_last_error()
    return raw.decode("utf-8", "replace") if raw else ""


def check(code, operation):
    """Raises MuondError for a nonzero status code returned by `operation`."""
    if code != 0:
        raise MuondError(code, last_error() or "(no message)", operation)


def call(name, *args):
    """Calls the status-returning C function `name` and raises MuondError when it fails."""
    check(function(name)(*args), name)
