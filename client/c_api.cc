// The C ABI of muond_client.h over the C++ client library.
#include <cstring>
#include <memory>
#include <string>

#include "client/client.h"
#include "absl/strings/str_cat.h"
#include "client/muond_client.h"
#include "common/dtype.h"
#include "common/layout.h"

struct muond_client {
  std::unique_ptr<muond::client::Client> impl;
};
struct muond_session {
  std::unique_ptr<muond::client::RankSession> impl;
  // The last step that ended OK through this handle was skipped (muond_session_last_step_skipped).
  bool last_skipped = false;
  double last_sum_sq = 0;  // muond_session_last_step_sum_sq
  // Records the outcome of a step call and returns its status.
  absl::Status Ended(const absl::StatusOr<muond::client::StepResult>& r) {
    if (r.ok()) {
      last_skipped = r->skipped;
      last_sum_sq = r->grad_sum_sq;
    }
    return r.status();
  }
};

namespace {

thread_local std::string g_last_error;

int Report(const absl::Status& s) {
  if (s.ok()) {
    g_last_error.clear();
    return 0;
  }
  g_last_error = std::string(s.message());
  return static_cast<int>(s.code());
}

int NullArgument(const char* what) {
  return Report(absl::InvalidArgumentError(std::string(what) + " is NULL"));
}

}  // namespace

// For the C ABI functions of other files (client_multinode.cc).
int muond_c_report(const absl::Status& s) { return Report(s); }
muond::client::Client* muond_c_client(muond_client* client) { return client->impl.get(); }

extern "C" {

const char* muond_last_error(void) { return g_last_error.c_str(); }

int muond_connect(const char* address, muond_client** out) {
  if (out == nullptr) return NullArgument("out");
  auto c = muond::client::Client::Connect(address == nullptr ? "" : address);
  if (!c.ok()) return Report(c.status());
  *out = new muond_client{*std::move(c)};
  return Report(absl::OkStatus());
}

int muond_connect_tls(const char* address, const char* ca_file, const char* cert_file,
                      const char* key_file, muond_client** out) {
  if (out == nullptr) return NullArgument("out");
  auto str = [](const char* s) { return s == nullptr ? std::string() : std::string(s); };
  auto c = muond::client::Client::Connect(
      str(address), muond::client::TlsOptions{str(ca_file), str(cert_file), str(key_file)});
  if (!c.ok()) return Report(c.status());
  *out = new muond_client{*std::move(c)};
  return Report(absl::OkStatus());
}

void muond_client_free(muond_client* client) { delete client; }

int muond_health(muond_client* client, double timeout_seconds) {
  if (client == nullptr) return NullArgument("client");
  return Report(client->impl->Health(timeout_seconds));
}

int muond_job_create(muond_client* client, const char* spec_json, char* token_buf,
                     size_t token_buf_len) {
  if (client == nullptr) return NullArgument("client");
  if (spec_json == nullptr) return NullArgument("spec_json");
  if (token_buf == nullptr) return NullArgument("token_buf");
  auto spec = muond::common::ParseJobSpecJson(spec_json);
  if (!spec.ok()) return Report(spec.status());
  auto token = client->impl->CreateJob(*spec);
  if (!token.ok()) return Report(token.status());
  if (token->size() + 1 > token_buf_len) {
    // The job exists; its token must not be lost: delete it again rather than leak it.
    (void)client->impl->DeleteJob(spec->job_id, *token);
    return Report(absl::InvalidArgumentError("token_buf is too small (needs 65 bytes)"));
  }
  std::memcpy(token_buf, token->c_str(), token->size() + 1);
  return Report(absl::OkStatus());
}

int muond_job_delete(muond_client* client, const char* job_id, const char* token) {
  if (client == nullptr || job_id == nullptr || token == nullptr) {
    return NullArgument("client, job_id or token");
  }
  return Report(client->impl->DeleteJob(job_id, token));
}

int muond_job_reset(muond_client* client, const char* job_id, const char* token,
                    int64_t next_step) {
  if (client == nullptr || job_id == nullptr || token == nullptr) {
    return NullArgument("client, job_id or token");
  }
  return Report(client->impl->ResetJob(job_id, token, next_step));
}

int muond_checkpoint_save(muond_client* client, const char* job_id, const char* token,
                          int64_t* generation, int64_t* step) {
  if (client == nullptr || job_id == nullptr || token == nullptr) {
    return NullArgument("client, job_id or token");
  }
  auto info = client->impl->SaveCheckpoint(job_id, token);
  if (!info.ok()) return Report(info.status());
  if (generation != nullptr) *generation = info->generation();
  if (step != nullptr) *step = info->step();
  return Report(absl::OkStatus());
}

int muond_checkpoint_load(muond_client* client, const char* job_id, const char* token,
                          int64_t generation, int64_t step, int64_t* loaded_generation,
                          int64_t* next_step) {
  if (client == nullptr || job_id == nullptr || token == nullptr) {
    return NullArgument("client, job_id or token");
  }
  if (generation < -1 || step < -1) {
    return Report(absl::InvalidArgumentError(absl::StrCat(
        "muond_checkpoint_load: generation ", generation, " / step ", step,
        ": pass a generation >= 1 or -1, a step >= 0 or -1")));
  }
  if (generation == 0) {
    return Report(absl::NotFoundError(absl::StrCat(
        "job '", job_id, "': no checkpoint generation 0 (generations are numbered from 1)")));
  }
  auto loaded = client->impl->LoadCheckpoint(job_id, token, generation < 0 ? 0 : generation, step);
  if (!loaded.ok()) return Report(loaded.status());
  if (loaded_generation != nullptr) *loaded_generation = loaded->loaded().generation();
  if (next_step != nullptr) *next_step = loaded->next_step();
  return Report(absl::OkStatus());
}

int muond_attach(muond_client* client, const char* job_id, int rank, const char* token,
                 int takeover, const char* transport, muond_session** out) {
  if (client == nullptr || job_id == nullptr || token == nullptr || out == nullptr) {
    return NullArgument("client, job_id, token or out");
  }
  auto kind = muond::client::ParseTransport(transport == nullptr ? "auto" : transport);
  if (!kind.ok()) return Report(kind.status());
  auto s = client->impl->Attach(job_id, rank, token, takeover != 0, *kind);
  if (!s.ok()) return Report(s.status());
  *out = new muond_session{*std::move(s)};
  return Report(absl::OkStatus());
}

void muond_session_free(muond_session* session) { delete session; }

int muond_session_is_shm(const muond_session* session) {
  return session != nullptr &&
         session->impl->transport() == muond::client::Transport::kShm;
}

int muond_session_gradient_view(muond_session* session, int64_t step, void** data, size_t* size) {
  if (session == nullptr || data == nullptr || size == nullptr) {
    return NullArgument("session, data or size");
  }
  auto v = session->impl->GradientView(step);
  if (!v.ok()) return Report(v.status());
  *data = v->data;
  *size = v->size;
  return Report(absl::OkStatus());
}

int muond_session_update_view(muond_session* session, int64_t step, const void** data,
                              size_t* size) {
  if (session == nullptr || data == nullptr || size == nullptr) {
    return NullArgument("session, data or size");
  }
  auto v = session->impl->UpdateView(step);
  if (!v.ok()) return Report(v.status());
  *data = v->data;
  *size = v->size;
  return Report(absl::OkStatus());
}

int muond_step_in_place(muond_session* session, int64_t step) {
  if (session == nullptr) return NullArgument("session");
  return Report(session->Ended(session->impl->StepInPlace(step)));
}

int muond_step_post(muond_session* session, int64_t step, uint64_t byte_offset, uint64_t bytes,
                    int last) {
  if (session == nullptr) return NullArgument("session");
  return Report(session->impl->PostPart(step, byte_offset, bytes, last != 0));
}

int muond_step_progress(muond_session* session, int64_t step, double timeout_seconds,
                        uint8_t* ready, size_t capacity, int* ended) {
  if (session == nullptr) return NullArgument("session");
  if (ended == nullptr) return NullArgument("ended");
  if (ready == nullptr && capacity > 0) return NullArgument("ready");
  std::vector<bool> spans;
  bool done = false;
  absl::Status s = session->impl->PartsProgress(step, timeout_seconds, &spans, &done);
  for (size_t i = 0; i < capacity; ++i) ready[i] = i < spans.size() && spans[i] ? 1 : 0;
  *ended = done ? 1 : 0;
  return Report(s);
}

int muond_step_wait(muond_session* session, int64_t step, int* replayed) {
  if (session == nullptr) return NullArgument("session");
  auto r = session->impl->WaitParts(step);
  if (r.ok() && replayed != nullptr) *replayed = r->replayed ? 1 : 0;
  return Report(session->Ended(r));
}

int muond_session_last_step_skipped(const muond_session* session) {
  return session != nullptr && session->last_skipped ? 1 : 0;
}

double muond_session_last_step_sum_sq(const muond_session* session) {
  return session != nullptr ? session->last_sum_sq : 0;
}

int muond_session_set_global_clip(muond_session* session, int mode, double sum_sq) {
  if (session == nullptr) return Report(absl::InvalidArgumentError("session is NULL"));
  return Report(session->impl->SetGlobalClip(mode, sum_sq));
}

int muond_session_set_outside_sum_sq(muond_session* session, double sum_sq) {
  if (session == nullptr) return Report(absl::InvalidArgumentError("session is NULL"));
  return Report(session->impl->SetOutsideSumSq(sum_sq));
}

int64_t muond_session_next_step(const muond_session* session) {
  return session == nullptr ? -1 : session->impl->next_step_at_attach();
}

namespace {

size_t CopySpans(const std::vector<muond::common::ShardSpan>& all, muond_shard_span* spans,
                 size_t capacity) {
  for (size_t i = 0; i < all.size() && i < capacity && spans != nullptr; ++i) {
    spans[i] = muond_shard_span{all[i].matrix, all[i].offset, all[i].length, all[i].rank_offset};
  }
  return all.size();
}

}  // namespace

int muond_layout_spans(const char* spec_json, int rank, muond_shard_span* spans, size_t capacity,
                       size_t* total, uint64_t* buffer_elements) {
  if (spec_json == nullptr) return NullArgument("spec_json");
  auto spec = muond::common::ParseJobSpecJson(spec_json);
  if (!spec.ok()) return Report(spec.status());
  if (rank < 0 || rank >= spec->world_size) {
    return Report(absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the world size [0, ", spec->world_size, ")")));
  }
  const size_t n = CopySpans(muond::common::RankSpans(*spec, rank), spans, capacity);
  if (total != nullptr) *total = n;
  if (buffer_elements != nullptr) *buffer_elements = muond::common::RankBufferElements(*spec, rank);
  return Report(absl::OkStatus());
}

size_t muond_session_spans(const muond_session* session, muond_shard_span* spans,
                           size_t capacity) {
  return session == nullptr ? 0 : CopySpans(session->impl->spans(), spans, capacity);
}

uint64_t muond_session_buffer_elements(const muond_session* session) {
  return session == nullptr ? 0 : session->impl->buffer_elements();
}

int muond_step_buffer(muond_session* session, int64_t step, const void* grads, void* updates) {
  if (session == nullptr || grads == nullptr || updates == nullptr) {
    return NullArgument("session, grads or updates");
  }
  return Report(session->Ended(session->impl->StepBuffer(step, grads, updates)));
}

int muond_step(muond_session* session, int64_t step, const muond_span* grads, size_t num_grads,
               const muond_span* updates, size_t num_updates) {
  if (session == nullptr) return NullArgument("session");
  if ((grads == nullptr && num_grads != 0) || (updates == nullptr && num_updates != 0)) {
    return NullArgument("grads or updates");
  }
  std::vector<muond::client::GradientSpan> in(num_grads);
  for (size_t i = 0; i < num_grads; ++i) {
    in[i] = {grads[i].matrix, grads[i].offset, grads[i].data, grads[i].length};
  }
  std::vector<muond::client::UpdateSpan> out(num_updates);
  for (size_t i = 0; i < num_updates; ++i) {
    out[i] = {updates[i].matrix, updates[i].offset, updates[i].data, updates[i].length};
  }
  return Report(session->Ended(session->impl->Step(step, in, out)));
}

int muond_session_set_hyper(muond_session* session, const char* const* groups, const double* lr,
                            const double* weight_decay, size_t num_groups, double grad_divisor) {
  if (session == nullptr) return NullArgument("session");
  if (num_groups != 0 && (groups == nullptr || lr == nullptr)) return NullArgument("groups or lr");
  muond::client::StepHyper hyper;
  hyper.grad_divisor = grad_divisor;
  for (size_t i = 0; i < num_groups; ++i) {
    if (groups[i] == nullptr) return NullArgument("a group name");
    hyper.lr.emplace_back(groups[i], lr[i]);
    if (weight_decay != nullptr) hyper.weight_decay.emplace_back(groups[i], weight_decay[i]);
  }
  return Report(session->impl->SetHyper(hyper));
}

int muond_session_set_absent(muond_session* session, const uint32_t* tensors, size_t count) {
  if (session == nullptr) return NullArgument("session");
  if (count != 0 && tensors == nullptr) return NullArgument("tensors");
  return Report(session->impl->SetAbsent(std::vector<uint32_t>(tensors, tensors + count)));
}

int muond_session_set_max_logits(muond_session* session, const float* logits, size_t count) {
  if (session == nullptr) return NullArgument("session");
  if (count != 0 && logits == nullptr) return NullArgument("logits");
  // Bounded before the copy: the job's pairs have at most this many query heads.
  if (count > muond::common::kMaxQkClipLogits) {
    return Report(absl::InvalidArgumentError(absl::StrCat("muond_session_set_max_logits: ", count,
                                                          " values; at most ",
                                                          muond::common::kMaxQkClipLogits)));
  }
  return Report(session->impl->SetMaxLogits(std::vector<float>(logits, logits + count)));
}

int muond_init_params(muond_session* session, const muond_span* params, size_t num_params,
                      int float32) {
  if (session == nullptr) return NullArgument("session");
  if (params == nullptr && num_params != 0) return NullArgument("params");
  std::vector<muond::client::GradientSpan> in(num_params);
  for (size_t i = 0; i < num_params; ++i) {
    in[i] = {params[i].matrix, params[i].offset, params[i].data, params[i].length};
  }
  return Report(session->impl->InitParams(in, float32 != 0));
}

int muond_init_params_buffer(muond_session* session, const void* params, int float32) {
  if (session == nullptr || params == nullptr) return NullArgument("session or params");
  return Report(session->impl->InitParamsBuffer(params, float32 != 0));
}

int muond_session_init_view(muond_session* session, void** data, size_t* size) {
  if (session == nullptr || data == nullptr || size == nullptr) {
    return NullArgument("session, data or size");
  }
  auto v = session->impl->InitParamsView();
  if (!v.ok()) return Report(v.status());
  *data = v->data;
  *size = v->size;
  return Report(absl::OkStatus());
}

int muond_init_params_in_place(muond_session* session) {
  if (session == nullptr) return NullArgument("session");
  return Report(session->impl->InitParamsInPlace());
}

int muond_session_param_byte_offset(const muond_session* session, size_t span, uint64_t* offset) {
  if (session == nullptr || offset == nullptr) return NullArgument("session or offset");
  auto at = session->impl->ParamByteOffset(span);
  if (!at.ok()) return Report(at.status());
  *offset = *at;
  return Report(absl::OkStatus());
}

int muond_export(muond_client* client, const char* job_id, const char* token, const char* dtype,
                 const char* out_path) {
  if (client == nullptr || job_id == nullptr || token == nullptr || out_path == nullptr) {
    return NullArgument("client, job_id, token or out_path");
  }
  auto parsed = muond::common::ParseDType(dtype == nullptr ? "float32" : dtype);
  if (!parsed.ok()) return Report(parsed.status());
  return Report(
      muond::client::ExportParamsToFile(*client->impl, job_id, token, *parsed, out_path).status());
}

int muond_checkpoint_export(muond_client* client, const char* job_id, const char* token,
                            int64_t generation, int64_t step, const char* dir,
                            int64_t* exported_step) {
  return muond_checkpoint_export_as(client, job_id, token, generation, step, dir, nullptr,
                                    exported_step);
}

int muond_checkpoint_export_as(muond_client* client, const char* job_id, const char* token,
                               int64_t generation, int64_t step, const char* dir, const char* dtype,
                               int64_t* exported_step) {
  if (client == nullptr || job_id == nullptr || token == nullptr || dir == nullptr) {
    return NullArgument("client, job_id, token or dir");
  }
  auto float32 = muond::client::ParseExportStateDType(dtype == nullptr ? "held" : dtype);
  if (!float32.ok()) return Report(float32.status());
  auto files = muond::client::ExportStateToDir(*client->impl, job_id, token, generation, step, dir,
                                               {}, *float32);
  if (files.ok() && exported_step != nullptr) *exported_step = files->step;
  return Report(files.status());
}

int muond_job_create_from_export(muond_client* client, const char* spec_json,
                                 const char* import_dir, char* token_buf, size_t token_buf_len) {
  if (client == nullptr || spec_json == nullptr || import_dir == nullptr || token_buf == nullptr) {
    return NullArgument("client, spec_json, import_dir or token_buf");
  }
  auto spec = muond::common::ParseJobSpecJson(spec_json);
  if (!spec.ok()) return Report(spec.status());
  auto token = client->impl->CreateJobFromExport(*spec, import_dir);
  if (!token.ok()) return Report(token.status());
  if (token->size() + 1 > token_buf_len) {
    (void)client->impl->DeleteJob(spec->job_id, *token);  // as muond_job_create
    return Report(absl::InvalidArgumentError("token_buf is too small (needs 65 bytes)"));
  }
  std::memcpy(token_buf, token->c_str(), token->size() + 1);
  return Report(absl::OkStatus());
}

}  // extern "C"
