#!/usr/bin/python3
"""MuonWithAuxAdam.load_state_dict() is all or nothing and never loses the job's state: a small
nn.Module trained with a real backward, one rank over shared memory, update and apply mode.

Usage: load_state_dict_test.py MUOND_BIN LIBMUOND_CLIENT DATA_DIR [unittest names...]
  - RefusedLoadTest (a daemon for the class): a state by name that is refused (a damaged
    payload: DATA_LOSS; tensors of other shapes; a bad file name, refused before the job is
    touched) leaves opt.state (the same tensor objects, the same values), param_groups and
    step_id as they were and the job's state too (the next steps equal a twin's that never
    tried, bit for bit); a state_dict torch refuses (a param group
    missing, a group's use_muon flipped) reaches no daemon (the job's export is byte-identical,
    the session stays attached); a load that succeeds continues the source's trajectory. No
    muon-state-* directory is left in the temporary directory (tempfile.tempdir per test).
  - DaemonKilledTest (a daemon per test, MUOND_TEST_IMPORT_FAULT=KILL:N): the daemon dies while
    importing, so the import fails and the restore from the backup fails too (update mode:
    killed in the import of the new state; apply mode: the new state refused, killed in the
    restore). The error names the backup directory, which holds the state the job had; a daemon
    restarted on the same state directory creates the job from it (`muonctl job create
    --import-dir`, as the error says, in update mode; Client.create_job in apply mode), and the
    steps after equal those of a twin that never tried, bit for bit. The backup is the only
    muon-state-* entry left.
  - CompatTest (a daemon for the class): the state_dicts an earlier release saved
    (DATA_DIR/state_dict_v1_<mode>.pt, written by state_dict_fixtures.py) load into a new job of
    the current optimizer in update and apply mode: step_id, the AdamW state (step counts and
    moments) and the job's state by tensor name (momentum; in apply mode also the masters and
    AdamW moments) equal what was saved, and the next step gives the parameters the saving
    optimizer's next step gave.
"""
import copy
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import muon_offload_test as base  # noqa: E402  (parses MUOND_BIN LIBMUOND_CLIENT DATA_DIR)
from muon_offload_test import Daemon  # noqa: E402

MUONCTL = os.path.join(os.path.dirname(base.MUOND), "muonctl")

import torch  # noqa: E402

import muon_offload as mo  # noqa: E402
from apply_harness import read_safetensors  # noqa: E402
import state_dict_fixtures as fixtures  # noqa: E402
from muon_offload import MuondError, MuonWithAuxAdam  # noqa: E402

torch.set_num_threads(1)


class Net(torch.nn.Module):
    """Embedding, two hidden Linear layers (their weights are the Muon matrices), LayerNorm and
    head: every other parameter is AdamW's."""

    def __init__(self, hidden=32, seed=3):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(16, 24)
        self.fc1 = torch.nn.Linear(24, hidden)
        self.fc2 = torch.nn.Linear(hidden, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.head = torch.nn.Linear(24, 16)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        return self.head(self.norm(h))


def make(daemon, mode, job_id, hidden=32, model=None, **kw):
    """(model, optimizer): a Net (or `model`) and a MuonWithAuxAdam of job `job_id` over it."""
    model = Net(hidden) if model is None else model
    muon = [(n, p) for n, p in model.named_parameters() if n in ("fc1.weight", "fc2.weight")]
    adam = [(n, p) for n, p in model.named_parameters() if n not in ("fc1.weight", "fc2.weight")]
    opt = MuonWithAuxAdam([dict(params=muon, use_muon=True, lr=0.02, weight_decay=0.01),
                           dict(params=adam, use_muon=False, lr=3e-3, betas=(0.9, 0.95),
                                weight_decay=0.01)],
                          mode=mode, address=daemon.address, job_id=job_id, transport="shm",
                          **kw)
    return model, opt


def train(model, opt, steps, seed=0):
    """Steps with a real forward and backward on the batches of seeds seed+t; the parameters
    after each."""
    after = []
    for t in steps:
        g = torch.Generator().manual_seed(seed + t)
        x = torch.randint(0, 16, (4, 6), generator=g)
        y = torch.randint(0, 16, (4, 6), generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        after.append(snapshot(model))
    return after


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


def damaged(sd):
    """`sd` with one byte of its safetensors payload flipped (the last: array data)."""
    sd = dict(sd, muond_state=dict(sd["muond_state"]))
    files = dict(sd["muond_state"]["files"])
    name = next(n for n in files if n.endswith(".safetensors"))
    data = bytearray(files[name])
    data[-1] ^= 0x40
    files[name] = bytes(data)
    sd["muond_state"]["files"] = files
    return sd


def torch_side(opt):
    """What torch's load_state_dict replaces, for comparing: {param index: {key: value}} with
    the tensor objects themselves, and the groups without their params."""
    index = {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state = {index[p]: dict(s) for p, s in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, groups


class LoadCase(unittest.TestCase):
    """A temporary directory of the test's own as tempfile's (the optimizer's muon-state-*
    directories go there)."""

    def setUp(self):
        self.tmpdir = tempfile.mkdtemp(prefix="lsd-tmp-")
        self.saved_tempdir = tempfile.tempdir
        tempfile.tempdir = self.tmpdir

    def tearDown(self):
        tempfile.tempdir = self.saved_tempdir
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def leftovers(self):
        return sorted(n for n in os.listdir(self.tmpdir) if n.startswith("muon-state-"))

    def assertSameTorchSide(self, before, opt):
        """opt's state holds the same tensor objects with the same values as `before` (a
        torch_side() taken with deep copies beside it), and the same groups."""
        (state, groups), (values, group_values) = before
        now_state, now_groups = torch_side(opt)
        self.assertEqual(sorted(now_state), sorted(state))
        for i, s in state.items():
            self.assertEqual(sorted(now_state[i]), sorted(s), f"param {i}")
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    self.assertIs(now_state[i][k], v, f"param {i} {k}: another tensor")
                    self.assertTrue(torch.equal(v, values[i][k]), f"param {i} {k} changed")
                else:
                    self.assertEqual(now_state[i][k], values[i][k], f"param {i} {k}")
        self.assertEqual(now_groups, group_values)
        self.assertEqual(now_groups, groups)

    def assertSameParams(self, got, want, what):
        for n in want:
            self.assertTrue(torch.equal(got[n], want[n]),
                            f"{what} {n}: max diff {(got[n] - want[n]).abs().max()}")


def torch_side_copy(opt):
    state, groups = torch_side(opt)
    return (state, groups), (copy.deepcopy(state), copy.deepcopy(groups))


class RefusedLoadTest(LoadCase):

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.close(unittest.TestCase())

    def source_state(self, mode, job_id, hidden=32):
        """A state_dict by name after 3 steps on other batches (AdamW moments and momentum that
        differ from the victim's), its AdamW lr changed."""
        model, opt = make(self.daemon, mode, job_id, hidden)
        train(model, opt, range(3), seed=100)
        sd = roundtrip(opt.state_dict())
        opt.close(delete_job=True)
        self.assertIn("muond_state", sd)
        sd["param_groups"][1]["lr"] = 0.25
        return sd

    def refused_load(self, mode, tag, bad_sd, code_name):
        """A victim and its twin train 2 steps; the victim's load_state_dict(bad_sd) is refused
        with `code_name`, its torch side as it was, step_id 2 and no temporary directory left.
        Returns (the error, the victim's token before, model, opt, twin_model, twin)."""
        model, opt = make(self.daemon, mode, f"victim-{tag}")
        twin_model, twin = make(self.daemon, mode, f"twin-{tag}")
        train(model, opt, range(2))
        train(twin_model, twin, range(2))
        token = opt.token
        before = torch_side_copy(opt)
        if mode == "update":
            self.assertTrue(before[0][0], "update mode keeps AdamW state in opt.state")
        with self.assertRaises(MuondError) as e:
            opt.load_state_dict(bad_sd)
        self.assertEqual(e.exception.code_name, code_name, e.exception.message)
        self.assertEqual(opt.step_id, 2)
        self.assertSameTorchSide(before, opt)
        self.assertEqual(self.leftovers(), [])
        return e.exception, token, model, opt, twin_model, twin

    def continues_as_twin(self, model, opt, twin_model, twin, what):
        """Steps 2 and 3 of the victim equal its twin's, bit for bit; both jobs are deleted."""
        got, want = train(model, opt, range(2, 4)), train(twin_model, twin, range(2, 4))
        for i in range(2):
            self.assertSameParams(got[i], want[i], f"{what} step {2 + i}")
        opt.close(delete_job=True)
        twin.close(delete_job=True)

    def refused_changes_nothing(self, mode, bad_sd, code_name):
        error, token, model, opt, twin_model, twin = self.refused_load(
            mode, f"{mode}-{code_name.lower()}", bad_sd, code_name)
        self.assertIn("restored to the state it had", error.message)
        self.assertNotEqual(opt.token, token)  # the job was re-made from its backup
        self.continues_as_twin(model, opt, twin_model, twin, mode)

    def test_damaged_payload_refused_update_mode(self):
        sd = self.source_state("update", "src-update-damaged")
        self.refused_changes_nothing("update", damaged(sd), "DATA_LOSS")

    def test_damaged_payload_refused_apply_mode(self):
        sd = self.source_state("apply", "src-apply-damaged")
        self.refused_changes_nothing("apply", damaged(sd), "DATA_LOSS")

    def test_other_shapes_refused(self):
        for mode in ("update", "apply"):
            sd = self.source_state(mode, f"src-{mode}-wide", hidden=40)
            self.refused_changes_nothing(mode, sd, "INVALID_ARGUMENT")

    def test_bad_file_entry_refused_before_the_job_is_touched(self):
        """A file name that is not a plain name is refused before any backup or delete: the
        same job (token) is attached again."""
        sd = self.source_state("update", "src-update-entry")
        files = dict(sd["muond_state"]["files"])
        files["../escape.json"] = b"{}"
        sd["muond_state"] = dict(sd["muond_state"], files=files)
        error, token, model, opt, twin_model, twin = self.refused_load(
            "update", "update-entry", sd, "INVALID_ARGUMENT")
        self.assertIn("bad file entry '../escape.json'", error.message)
        self.assertIn("left as it was", error.message)
        self.assertEqual(opt.token, token)
        self.assertIsNotNone(opt.session)
        self.continues_as_twin(model, opt, twin_model, twin, "update")

    def test_torch_side_refusal_touches_no_daemon(self):
        for mode in ("update", "apply"):
            sd = self.source_state(mode, f"src-{mode}-groups")
            model, opt = make(self.daemon, mode, f"victim-{mode}-groups")
            train(model, opt, range(2))
            export_dir = os.path.join(self.tmpdir, f"export-{mode}")
            os.mkdir(export_dir)
            opt.client.export_state(opt.job_id, opt.token, export_dir)
            token, session = opt.token, opt.session
            before = torch_side_copy(opt)
            one_group = dict(sd, param_groups=sd["param_groups"][:1])
            with self.assertRaises(ValueError) as e:
                opt.load_state_dict(one_group)
            self.assertIn("different number of parameter groups", str(e.exception))
            flipped = copy.deepcopy({k: v for k, v in sd.items() if k != "muond_state"})
            flipped["muond_state"] = sd["muond_state"]
            flipped["param_groups"][1]["use_muon"] = True
            with self.assertRaises(ValueError) as e:
                opt.load_state_dict(flipped)
            self.assertIn("use_muon", str(e.exception))
            self.assertIs(opt.session, session)  # never detached
            self.assertEqual(opt.token, token)
            self.assertEqual(opt.step_id, 2)
            self.assertSameTorchSide(before, opt)
            self.assertEqual(self.leftovers(), [])
            again = os.path.join(self.tmpdir, f"export-{mode}-again")
            os.mkdir(again)
            opt.client.export_state(opt.job_id, opt.token, again)
            for name in sorted(os.listdir(export_dir)):
                with open(os.path.join(export_dir, name), "rb") as a, \
                        open(os.path.join(again, name), "rb") as b:
                    self.assertEqual(a.read(), b.read(), f"{mode}: {name} changed")
            opt.close(delete_job=True)

    def test_success_continues_the_source(self):
        for mode in ("update", "apply"):
            model, opt = make(self.daemon, mode, f"ok-src-{mode}")
            train(model, opt, range(3))
            at3 = snapshot(model)
            sd = roundtrip(opt.state_dict())
            want = train(model, opt, range(3, 5))
            opt.close(delete_job=True)
            model2, opt2 = make(self.daemon, mode, f"ok-dst-{mode}")
            train(model2, opt2, range(1), seed=50)  # a state of its own, replaced
            with torch.no_grad():
                for n, p in model2.named_parameters():
                    p.copy_(at3[n])
            opt2.load_state_dict(sd)
            self.assertEqual(opt2.step_id, 3)
            self.assertEqual(self.leftovers(), [])
            if mode == "update":
                self.assertEqual(opt2.state[model2.head.bias]["step"], 3)
            got = train(model2, opt2, range(3, 5))
            for i in range(2):
                self.assertSameParams(got[i], want[i], f"{mode} step {3 + i}")
            opt2.close(delete_job=True)


class DaemonKilledTest(LoadCase):

    def killed_in_import(self, mode, fault, bad, restore_with):
        """The victim (2 steps) loads a state (the source's; damaged when `bad`) on a daemon armed
        with MUOND_TEST_IMPORT_FAULT=`fault`: both creates fail; the job comes back on a restarted
        daemon from the backup the error names (created with `restore_with`: "muonctl" or
        "python")."""
        daemon = Daemon(env={"MUOND_TEST_IMPORT_FAULT": fault})
        try:
            # What the victim would do without the load: a twin's steps 2 and 3.
            twin_model, twin = make(daemon, mode, f"twin-{mode}")
            train(twin_model, twin, range(2))
            want = train(twin_model, twin, range(2, 4))
            twin.close(delete_job=True)
            src_model, src = make(daemon, mode, f"src-{mode}")
            train(src_model, src, range(3), seed=100)
            sd = roundtrip(src.state_dict())
            src.close(delete_job=True)
            if bad:
                sd = damaged(sd)
            model, opt = make(daemon, mode, f"victim-{mode}")
            train(model, opt, range(2))
            mine = os.path.join(self.tmpdir, "victim-export")
            os.mkdir(mine)
            opt.client.export_state(opt.job_id, opt.token, mine)
            before = torch_side_copy(opt)
            with self.assertRaises(MuondError) as e:
                opt.load_state_dict(sd)
            message = e.exception.message
            self.assertEqual(daemon.proc.wait(timeout=30), -signal.SIGKILL)
            daemon.log.close()
            self.assertIn("test hook MUOND_TEST_IMPORT_FAULT", daemon.read_log())
            self.assertEqual(e.exception.code_name, "UNAVAILABLE", message)
            found = re.search(r"is kept in (\S+): re-create", message)
            self.assertIsNotNone(found, message)
            backup = found.group(1)
            self.assertIn(f"--import-dir {backup}", message)
            self.assertEqual(os.path.dirname(backup), self.tmpdir)
            self.assertTrue(os.path.basename(backup).startswith(
                f"muon-state-backup-victim-{mode}-"))
            self.assertEqual(os.stat(backup).st_mode & 0o777, 0o711)
            self.assertEqual(self.leftovers(), [os.path.basename(backup)])
            # The backup is the victim's state at step 2, array for array.
            self.assertEqual(sorted(os.listdir(backup)), sorted(os.listdir(mine)))
            name = next(n for n in os.listdir(mine) if n.endswith(".safetensors"))
            kept, exported = read_safetensors(os.path.join(backup, name)), \
                read_safetensors(os.path.join(mine, name))
            self.assertEqual(sorted(kept), sorted(exported))
            for k in exported:
                self.assertTrue(torch.equal(kept[k], exported[k]), k)
            self.assertEqual(opt.step_id, 2)
            self.assertSameTorchSide(before, opt)
            spec = dict(opt.spec)
            spec.pop("init_from", None)
            adam_state = torch.optim.Optimizer.state_dict(opt)
            opt.close()

            daemon.start(env={})  # the same state directory, no fault
            if restore_with == "muonctl":  # as the error says
                spec_path = os.path.join(self.tmpdir, "spec.json")
                with open(spec_path, "w") as f:
                    json.dump(spec, f)
                out = subprocess.run([MUONCTL, "--address", daemon.address, "job", "create",
                                      "--spec", spec_path, "--import-dir", backup],
                                     capture_output=True, text=True)
                self.assertEqual(out.returncode, 0, out.stderr)
                token = out.stdout.strip()
            else:
                with mo.Client(daemon.address) as c:
                    token = c.create_job(spec, import_dir=backup)
            # The trainer as it was (the failed load changed none of it) on the restored job.
            _, opt2 = make(daemon, mode, f"victim-{mode}", model=model, token=token)
            self.assertEqual(opt2.step_id, 2)
            torch.optim.Optimizer.load_state_dict(opt2, adam_state)
            got = train(model, opt2, range(2, 4))
            for i in range(2):
                self.assertSameParams(got[i], want[i], f"{mode} step {2 + i} after the restore")
            opt2.close(delete_job=True)
            shutil.rmtree(backup)
        finally:
            if daemon.proc.poll() is None:
                daemon.close(self)
            else:
                daemon.tmp.cleanup()

    def test_update_mode_killed_importing_the_new_state(self):
        self.killed_in_import("update", "KILL:1", bad=False, restore_with="muonctl")

    def test_apply_mode_refused_then_killed_restoring(self):
        self.killed_in_import("apply", "KILL:2", bad=True, restore_with="python")


def job_state(sd, tmpdir):
    """{tensor name: tensor} of the job's state a state_dict holds by name (muond_state)."""
    files = sd["muond_state"]["files"]
    name = next(n for n in files if n.endswith(".safetensors"))
    path = os.path.join(tmpdir, f"compat-{time.monotonic_ns()}.safetensors")
    with open(path, "wb") as f:
        f.write(files[name])
    try:
        return read_safetensors(path)
    finally:
        os.remove(path)


class CompatTest(LoadCase):
    """State_dicts saved by an earlier release load (see the module comment)."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.close(unittest.TestCase())

    def loads(self, mode):
        saved = torch.load(os.path.join(base.DATA, f"state_dict_v1_{mode}.pt"))
        model = torch.load(os.path.join(base.DATA, f"state_dict_v1_{mode}_model.pt"))
        ps = fixtures.params()
        with torch.no_grad():
            for n, p in ps.items():
                p.copy_(model["params"][n])
        opt = fixtures.optimizer(mo, self.daemon.address, mode, f"compat-{mode}", ps)
        opt.load_state_dict(copy.deepcopy(saved))
        self.assertEqual(opt.step_id, saved["step_id"])
        self.assertEqual(opt.step_id, 2)
        # The AdamW state (update mode; apply mode keeps none in the trainer), by param index.
        index = {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        state = {index[p]: s for p, s in opt.state.items()}
        self.assertEqual(sorted(state), sorted(saved["state"]))
        if mode == "update":
            self.assertEqual(sorted(state), [2, 3])
        for i, s in saved["state"].items():
            self.assertEqual(state[i]["step"], s["step"], f"param {i} step")
            self.assertEqual(state[i]["step"], 2)
            for k in ("exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.equal(state[i][k], s[k]), f"param {i} {k}")
        for g, sg in zip(opt.param_groups, saved["param_groups"]):
            self.assertEqual({k: v for k, v in g.items() if k != "params"},
                             {k: v for k, v in sg.items() if k != "params"})
        # The job's state (momentum; masters and moments in apply mode) as saved.
        want = job_state(saved, self.tmpdir)
        got = job_state(opt.state_dict(), self.tmpdir)
        self.assertEqual(sorted(got), sorted(want))
        self.assertIn("momentum/w1" if mode == "apply" else "w1", want)
        for n in want:
            self.assertTrue(torch.equal(got[n], want[n]), f"{mode} job state {n}")
        # The next step continues where the saving optimizer went.
        fixtures.set_grads(ps, 2)
        opt.step()
        self.assertEqual(opt.step_id, 3)
        self.assertSameParams(fixtures.snapshot(ps), model["next"], f"{mode} step 2")
        opt.close(delete_job=True)
        self.assertEqual(self.leftovers(), [])

    def test_update_mode_v1(self):
        self.loads("update")

    def test_apply_mode_v1(self):
        self.loads("apply")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:], verbosity=2)
