/* The muond client library's C ABI, for Python (ctypes) and other languages.
 *
 * Every function returns a status code: 0 on success, otherwise the gRPC status code of the
 * failure (3 INVALID_ARGUMENT, 5 NOT_FOUND, 9 FAILED_PRECONDITION, 14 UNAVAILABLE, ...).
 * muond_last_error() returns the message of the calling thread's last failure.
 * Handles are owned by the caller and released with the matching *_free function.
 * A muond_client may be shared between threads; a muond_session is used by one thread at a time.
 */
#ifndef MUOND_CLIENT_MUOND_CLIENT_H_
#define MUOND_CLIENT_MUOND_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct muond_client muond_client;
typedef struct muond_session muond_session;

/* A run of `length` consecutive elements of matrix `matrix` starting at element `offset`, in the
 * matrix's dtype, at `data` (read for gradients, written for updates). */
typedef struct muond_span {
  uint32_t matrix;
  uint64_t offset;
  void* data;
  uint64_t length;
} muond_span;

/* One run of a rank's shard: `length` elements of matrix `matrix` from element `offset`, stored at
 * element `rank_offset` of the rank's flat buffer (the ZeRO 1/2 partition, the ZeRO 3 chunks back to
 * back, or the explicit layout's spans back to back). */
typedef struct muond_shard_span {
  uint32_t matrix;
  uint64_t offset;
  uint64_t length;
  uint64_t rank_offset;
} muond_shard_span;

/* The spans `rank` owns under the layout of a job.json text (stage 1/2/3 or explicit), the same
 * computation the daemon uses. Writes up to `capacity` spans, *total gets the count and
 * *buffer_elements the size of the rank's flat buffer (either may be NULL). */
int muond_layout_spans(const char* spec_json, int rank, muond_shard_span* spans, size_t capacity,
                       size_t* total, uint64_t* buffer_elements);

/* The message of this thread's last failed call ("" if none). Valid until the next call. */
const char* muond_last_error(void);

/* address: "unix:///path", "HOST:PORT" or "tls://HOST:PORT"; NULL or "" for the default address.
 * tls:// addresses use TLS with the PEM files named by $MUOND_TLS_CA (the CA that signed the
 * daemon's certificate; unset: gRPC's default roots), $MUOND_TLS_CERT and $MUOND_TLS_KEY (a client
 * certificate for mutual TLS). */
int muond_connect(const char* address, muond_client** out);
/* The same with the TLS files given here instead of the environment (NULL or "": none); a file
 * given with an address that is not tls:// is INVALID_ARGUMENT. */
int muond_connect_tls(const char* address, const char* ca_file, const char* cert_file,
                      const char* key_file, muond_client** out);
void muond_client_free(muond_client* client);
/* 0 when the daemon is SERVING. */
int muond_health(muond_client* client, double timeout_seconds);

/* Creates a job from its job.json text. Writes the NUL-terminated token into token_buf
 * (at least 65 bytes). */
int muond_job_create(muond_client* client, const char* spec_json, char* token_buf,
                     size_t token_buf_len);
int muond_job_delete(muond_client* client, const char* job_id, const char* token);
int muond_job_reset(muond_client* client, const char* job_id, const char* token, int64_t next_step);

/* Attaches `rank`; ALREADY_EXISTS (6) when it is attached elsewhere, unless `takeover` is nonzero
 * (a restarted trainer replacing a session whose process is gone). `transport`: "auto" (or NULL:
 * shared memory when the daemon is on this host, else gRPC), "shm" or "grpc". */
/* Saves a checkpoint generation of the job; returns once it is durable. Out (may be NULL): the
 * generation and the step it was taken at (the job's next step then). */
int muond_checkpoint_save(muond_client* client, const char* job_id, const char* token,
                          int64_t* generation, int64_t* step);
/* Loads a generation: `generation` >= 1, or the one saved at `step` >= 0, or the newest good one
 * when both are -1. Out (may be NULL): the generation loaded and the job's next step. */
int muond_checkpoint_load(muond_client* client, const char* job_id, const char* token,
                          int64_t generation, int64_t step, int64_t* loaded_generation,
                          int64_t* next_step);

int muond_attach(muond_client* client, const char* job_id, int rank, const char* token,
                 int takeover, const char* transport, muond_session** out);
/* 1 when the session uses shared memory, 0 for gRPC. */
int muond_session_is_shm(const muond_session* session);
/* Detaches the rank (best effort) and frees the session. */
void muond_session_free(muond_session* session);
/* The step the job expected when the rank attached. */
int64_t muond_session_next_step(const muond_session* session);
/* The rank's spans (its shard of the job's matrices): writes up to `capacity` spans and returns
 * how many there are in total. */
size_t muond_session_spans(const muond_session* session, muond_shard_span* spans, size_t capacity);
/* Elements of the rank's flat buffer. */
uint64_t muond_session_buffer_elements(const muond_session* session);

/* Pushes the rank's gradients for `step` and fills the update spans (same elements). In apply
 * mode (DESIGN.md 4b) the "update" is the rank's new parameters, in each tensor's param_dtype, and
 * the step carries the hyperparameters of muond_session_set_hyper (9 FAILED_PRECONDITION
 * without them). */
int muond_step(muond_session* session, int64_t step, const muond_span* grads, size_t num_grads,
               const muond_span* updates, size_t num_updates);
/* Zero-copy steps (shared-memory sessions; FAILED_PRECONDITION otherwise): step t's gradient
 * buffer (writable, the rank's flat-buffer layout) and update buffer (read-only), t % B (B: the
 * job's "step_buffers", 1 or 2). Apply
 * mode: the update buffer holds the new parameters, span i at muond_session_param_byte_offset(i)
 * in its param_dtype; muond_step_in_place writes the hyperparameters into the gradient buffer
 * itself. */
int muond_session_gradient_view(muond_session* session, int64_t step, void** data, size_t* size);
int muond_session_update_view(muond_session* session, int64_t step, const void** data,
                              size_t* size);
/* Rings the doorbell for step t (its gradients already in the gradient view) and waits. */
int muond_step_in_place(muond_session* session, int64_t step);

/* A step in parts (shared-memory sessions; FAILED_PRECONDITION over gRPC): post
 * [byte_offset, byte_offset + bytes) of step t's gradient view, whole spans, as soon as it is
 * written; `last` != 0 marks the rank's last part (it may be empty). Returns without waiting for
 * the daemon. muond_step_progress waits at most timeout_seconds (< 0: until news) and sets
 * ready[i] (i < capacity) to 1 for each span whose result (update, or apply mode's new
 * parameters) of step t is in the update view, *ended to 1 when the step ended; a refused part
 * returns its error at once. The results announced are final only if the step commits:
 * muond_step_wait returns the outcome (and *replayed), as muond_step_in_place does. */
int muond_step_post(muond_session* session, int64_t step, uint64_t byte_offset, uint64_t bytes,
                    int last);
int muond_step_progress(muond_session* session, int64_t step, double timeout_seconds,
                        uint8_t* ready, size_t capacity, int* ended);
int muond_step_wait(muond_session* session, int64_t step, int* replayed);

/* The same with the rank's flat buffers (muond_session_buffer_elements elements of the job's one
 * dtype): `updates` gets the update in the same layout, padding zeroed. Apply mode: `grads` in the
 * one gradient dtype, `updates` the new parameters in the one param_dtype. */
int muond_step_buffer(muond_session* session, int64_t step, const void* grads, void* updates);

/* 1 when the last step that returned 0 on this session (muond_step, muond_step_in_place,
 * muond_step_wait, muond_step_buffer) was skipped: the job has "nonfinite": "skip" and some rank's
 * gradients held a NaN or Inf. Nothing in the daemon changed, the update (apply mode: the new
 * parameters) was not written, and the job's next step is the one after it. 0 otherwise. */
int muond_session_last_step_skipped(const muond_session* session);
/* Apply mode: the raw sum of squares of the gradients (before the divisor) of the last step that
 * ended OK through this handle, on its daemon (a node's share of a multi-node job's norm). Update
 * mode with max_grad_norm: the step's whole raw sum of squares (muond_session_set_outside_sum_sq). */
double muond_session_last_step_sum_sq(const muond_session* session);
/* Apply mode, a node of a multi-node job with max_grad_norm: the global clip the session's later
 * steps carry. mode 0: none (such a job refuses the step: FAILED_PRECONDITION), 1: compute with
 * clip 1 and report the node's sum of squares, 2: clip by `sum_sq`, the raw sum of squares over
 * every node (the coordinating client's all-reduce). 3 INVALID_ARGUMENT for another mode or a bad
 * sum. */
int muond_session_set_global_clip(muond_session* session, int mode, double sum_sq);
/* Update mode, a job with max_grad_norm: the sum of squares of this rank's gradients outside the
 * job (the tensors the trainer updates itself; count tensors held by several ranks once), which
 * the session's later steps carry with their last part. The daemon clips by the norm over the
 * job's matrices and every rank's share, and muond_session_last_step_sum_sq then returns that
 * whole raw sum of squares: clip the trainer's own tensors by
 * min(1, max_grad_norm / (sqrt(sum) + 1e-6)) as float32. 9 FAILED_PRECONDITION on a job that does
 * not clip in update mode, 3 INVALID_ARGUMENT for a negative value (a NaN or infinity is sent: the
 * daemon refuses, or under "nonfinite": "skip" skips, the step as for a non-finite gradient). */
int muond_session_set_outside_sum_sq(muond_session* session, double sum_sq);

/* ---- Apply mode (DESIGN.md 4b): the daemon holds the fp32 master weights and the optimizer
 * state and returns new parameters. On an update-mode job these return 9 FAILED_PRECONDITION. */

/* The hyperparameters every later step of the session carries: the lr of every parameter group
 * of the job (`groups[i]` gets `lr[i]`), their weight decay (`weight_decay` NULL: the groups'
 * defaults from the job spec) and the gradient divisor (the loss scale; 1 for none). 3
 * INVALID_ARGUMENT naming the group for a group without an lr, an unknown or repeated group, or a
 * value that is not finite and >= 0; for a divisor that is not finite and > 0. */
int muond_session_set_hyper(muond_session* session, const char* const* groups, const double* lr,
                            const double* weight_decay, size_t num_groups, double grad_divisor);
/* The presence mask every later step of the session carries: `tensors[0..count)` are the job
 * tensors (indices in the job's order) without a gradient this step on any rank; each is skipped
 * (master, optimizer state and step count unchanged, its parameters returned as they were).
 * count 0: every tensor has a gradient. Their gradient bytes are still sent and not used (send
 * zeros). Every rank of a step must send the same mask (else 3 INVALID_ARGUMENT for every rank).
 * 3 INVALID_ARGUMENT for an index out of range or named twice; 9 on an update-mode job. */
int muond_session_set_absent(muond_session* session, const uint32_t* tensors, size_t count);
/* QK-Clip (DESIGN.md 4e), a job with qk_clip pairs: the largest pre-softmax attention logit of each
 * query head this rank saw in the step's forward, `logits[0..count)` pair after pair in the job's
 * order (q_heads values each), carried by every later step of the session until set again (set it
 * before each step; the daemon takes the maximum over the ranks). 3 INVALID_ARGUMENT naming the
 * pair for a wrong count or a value that is not finite; 9 on a job without qk_clip. A step of a
 * qk_clip job before any is set: 3. */
int muond_session_set_max_logits(muond_session* session, const float* logits, size_t count);
/* The rank's part of the initial parameters: spans that cover the rank's spans exactly, whose
 * elements are float32 (`float32` nonzero) or each tensor's param_dtype. Over shared memory float32
 * values are rounded to the param_dtype on the client. */
int muond_init_params(muond_session* session, const muond_span* params, size_t num_params,
                      int float32);
/* The same from the rank's flat buffer (muond_session_buffer_elements elements): float32, or the
 * one param_dtype of every tensor (`float32` zero). */
int muond_init_params_buffer(muond_session* session, const void* params, int float32);
/* Zero-copy initial parameters (shared memory only): gradient buffer 0, where span i's parameters
 * go at muond_session_param_byte_offset(i) in its param_dtype; then muond_init_params_in_place. */
int muond_session_init_view(muond_session* session, void** data, size_t* size);
int muond_init_params_in_place(muond_session* session);
/* Where span i (of muond_session_spans) keeps its parameters in the update and init views
 * (shared memory; 9 FAILED_PRECONDITION over gRPC; 3 for a span out of range). */
int muond_session_param_byte_offset(const muond_session* session, size_t span, uint64_t* offset);
/* Writes the job's master weights to `out_path` as a safetensors model file (every tensor in full
 * shape under its name), as `muonctl export` does: a temporary file in the same directory, fsync,
 * rename. `dtype`: "float32" (or NULL), "bfloat16" or "float16". */
int muond_export(muond_client* client, const char* job_id, const char* token, const char* dtype,
                 const char* out_path);

/* ---- Many nodes (DESIGN.md 4c). */

/* Re-sharding through a full-state export: writes the job's whole optimizer state by tensor name
 * (live when generation is 0 and step -1; else checkpoint generation `generation` > 0, or the
 * newest one at `step` >= 0) into directory `dir` as <job>.safetensors and <job>.manifest.json,
 * as `muonctl checkpoint export` does; ALREADY_EXISTS (6) when either exists. Out (may be NULL):
 * the step of the state exported. */
int muond_checkpoint_export(muond_client* client, const char* job_id, const char* token,
                            int64_t generation, int64_t step, const char* dir,
                            int64_t* exported_step);
/* muond_checkpoint_export with the arrays' dtype chosen: "held" (or NULL: as the job holds them,
 * compressed state compressed, as muond_checkpoint_export) or "float32" (decoded);
 * INVALID_ARGUMENT (3) for anything else. */
int muond_checkpoint_export_as(muond_client* client, const char* job_id, const char* token,
                               int64_t generation, int64_t step, const char* dir, const char* dtype,
                               int64_t* exported_step);
/* muond_job_create whose job takes, for each of its tensors, the state found in export directory
 * `import_dir` (absolute; the files of every node's export, all of one step) and continues from
 * that step. */
int muond_job_create_from_export(muond_client* client, const char* spec_json,
                                 const char* import_dir, char* token_buf, size_t token_buf_len);

/* The ownership plan: which of `nodes` nodes owns each tensor of a job.json (the global job: all
 * tensors, any world size and stage). Deterministic (every rank computes the same plan): Muon
 * tensors whole, balanced by Newton-Schulz FLOPs; AdamW tensors by bytes of state, an AdamW
 * tensor larger than a node's share split by rows across nodes (client/ownership_plan.h). Writes
 * up to `capacity` owners (job order; a split tensor: the node of its first rows), *total the
 * tensor count, and per node (arrays of `nodes`, each may be NULL) its FLOPs per step
 * (Newton-Schulz and AdamW) and its bytes of fp32 state. 3 INVALID_ARGUMENT for a bad spec or
 * nodes outside 1..65536. */
int muond_ownership_plan(const char* spec_json, int nodes, int32_t* owner, size_t capacity,
                         size_t* total, double* node_flops, double* node_bytes);
/* The plan's pieces: rows [row_begin, row_end) of tensor `tensor` (job order) on node `node`, by
 * tensor then rows; a tensor not split is one piece of all its rows (its first dimension; 0-d: one
 * row). Writes up to `capacity` pieces (each array may be NULL), *total the count. */
int muond_ownership_pieces(const char* spec_json, int nodes, int32_t* tensor, int64_t* row_begin,
                           int64_t* row_end, int32_t* node, size_t capacity, size_t* total);
/* A multi-node job's two-phase step (the job spec has "multinode"): commit the prepared step
 * `step` (OK when it is committed already), or drop it (a prepared step, or one in flight whose
 * ranks then get ABORTED with `reason`; the daemon's state stays bit-identical and the job expects
 * `step` again). 9 FAILED_PRECONDITION: commit of a step not prepared, abort of a committed one. */
/* The job's checkpoint generations, newest first: up to `capacity` generation numbers and the steps
 * they were taken at (either array may be NULL), *total the count. (A multi-node job loads the
 * newest step every node has.) */
int muond_checkpoint_list(muond_client* client, const char* job_id, const char* token,
                          int64_t* generations, int64_t* steps, size_t capacity, size_t* total);
int muond_step_commit(muond_client* client, const char* job_id, const char* token, int64_t step);
int muond_step_abort(muond_client* client, const char* job_id, const char* token, int64_t step,
                     const char* reason);
/* Undoes committed step `step` of a multi-node job when its commit did not reach every node (the
 * last step committed, before any later step began or a checkpoint was saved or loaded): the
 * state before it comes back and the job expects `step` again; a node that never committed it
 * drops it. 9 FAILED_PRECONDITION when it can no longer be rolled back (load a checkpoint). A commit
 * waits at most 20 s for a daemon being restarted; an abort or a rollback fails at once when the
 * daemon cannot be reached, and after 20 s when it does not answer. */
int muond_step_rollback(muond_client* client, const char* job_id, const char* token, int64_t step,
                        const char* reason);

#ifdef __cplusplus
}
#endif

#endif /* MUOND_CLIENT_MUOND_CLIENT_H_ */
