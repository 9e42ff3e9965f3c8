// Writes the seed corpora of the fuzz targets into tests/fuzz/corpus/<target>/ from valid inputs
// made by the code itself (job specs, their API messages, safetensors files, checkpoint
// generations written by the Store, attach requests, doorbells, config files, HTTP requests,
// export manifests, job and reset records).
// Built with the fuzz targets (build-fuzz/fuzz_make_seeds); run from the repository root:
//   build-fuzz/fuzz_make_seeds tests/fuzz/corpus
// The seeds are committed; rerun when a format changes.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/safetensors.h"
#include "common/shm_protocol.h"
#include "common/state_export.h"
#include "muond/v1/muond.pb.h"
#include "nlohmann/json.hpp"
#include "server/storage/checkpoint.h"

namespace fs = std::filesystem;

namespace {

std::string out_dir;

void Put(const std::string& target, const std::string& name, const std::string& bytes) {
  fs::create_directories(out_dir + "/" + target);
  std::ofstream(out_dir + "/" + target + "/" + name, std::ios::binary) << bytes;
}

const char* const kSpecs[] = {
    R"({"job_id": "j1", "matrices": [{"name": "w", "shape": [4, 8]}]})",
    R"({"job_id": "llama.7b_run-3", "world_size": 8, "zero_stage": 3,
        "muon": {"momentum": 0.9, "nesterov": false, "ns_method": "polar_express", "ns_steps": 7,
                 "compute_dtype": "bf16", "scale_mode": "match_rms_adamw", "fp32_iterations": 2},
        "matrices": [{"name": "attn.qkv", "shape": [384, 128], "num_heads": 6, "dtype": "bfloat16"},
                     {"name": "experts", "shape": [8, 96, 64], "num_heads": 4, "dtype": "fp16"},
                     {"name": "conv", "shape": [64, 3, 3, 3], "num_heads": 2}],
        "checkpoint_every_steps": 10, "checkpoint_keep": 2, "step_timeout_seconds": 60,
        "gather_budget_bytes": 1048576})",
    R"({"job_id": "z2", "world_size": 3, "zero_stage": 2, "muon": {"ns_method": "gram"},
        "matrices": [{"name": "a", "shape": [5, 7]}, {"name": "b", "shape": [3, 3]}]})",
    R"({"job_id": "ex", "world_size": 2, "matrices": [{"name": "a", "shape": [2, 4]},
        {"name": "b", "shape": [4, 2]}],
        "layout": [[{"matrix": "a", "offset": 0, "length": 8}, {"matrix": "b", "offset": 0, "length": 3}],
                   [{"matrix": "b", "offset": 3, "length": 5}]]})",
    R"({"job_id": "a1", "mode": "apply", "world_size": 2, "zero_stage": 3,
        "tensors": [
          {"name": "wq", "shape": [64, 32], "dtype": "bfloat16", "param_dtype": "bfloat16"},
          {"name": "embed", "shape": [100, 32], "optimizer": "adamw", "group": "embed",
           "dtype": "bfloat16", "param_dtype": "float32"},
          {"name": "norm", "shape": [32], "optimizer": "adamw", "group": "embed"},
          {"name": "scale", "shape": [], "optimizer": "adamw", "group": "embed"}],
        "groups": [{"name": "muon", "lr": 0.02, "weight_decay": 0.01}, {"name": "embed", "lr": 0.001}],
        "adamw": {"betas": [0.9, 0.95], "eps": 1e-10},
        "max_grad_norm": 1.0, "init_from": "/var/lib/models/init.safetensors"})",
    R"({"job_id": "mn", "world_size": 2, "zero_stage": 1,
        "multinode": {"global_job_id": "g", "node": 1, "nodes": 2},
        "matrices": [{"name": "w", "shape": [16, 16]}]})",
    R"({"job_id": "qk", "mode": "apply", "world_size": 2, "zero_stage": 2,
        "tensors": [{"name": "q", "shape": [32, 24]}, {"name": "k", "shape": [8, 24]}],
        "groups": [{"name": "muon", "lr": 0.02}],
        "qk_clip": {"threshold": 100, "alpha": 0.5, "pairs": [
          {"q": "q", "k": "k", "q_heads": 8, "kv_heads": 2, "head_dim": 4}]}})",
};

std::vector<muond::common::JobSpec> Specs() {
  std::vector<muond::common::JobSpec> specs;
  for (const char* text : kSpecs) {
    auto spec = muond::common::ParseJobSpecJson(text);
    if (!spec.ok()) {
      std::cerr << "seed spec refused: " << spec.status() << "\n" << text << "\n";
      continue;
    }
    specs.push_back(*spec);
  }
  return specs;
}

void JobSpecSeeds(const std::vector<muond::common::JobSpec>& specs) {
  for (size_t i = 0; i < specs.size(); ++i) {
    Put("job_spec_json", "seed-" + std::to_string(i), muond::common::JobSpecToJson(specs[i]));
    Put("job_spec_proto", "seed-" + std::to_string(i),
        muond::common::JobSpecToProto(specs[i]).SerializeAsString());
  }
}

void SafetensorsSeeds() {
  const float f[6] = {1, -2, 3.5f, 0, 1e-3f, 7};
  const uint16_t h[4] = {0x3c00, 0xbc00, 0x7bff, 0x0001};
  auto a = muond::common::SerializeSafetensors(
      {{"w", muond::common::DType::kFloat32, {2, 3}, {reinterpret_cast<const char*>(f), 24}},
       {"h", muond::common::DType::kBFloat16, {4}, {reinterpret_cast<const char*>(h), 8}},
       {"s", muond::common::DType::kFloat16, {}, {reinterpret_cast<const char*>(h), 2}}},
      {{"format", "pt"}});
  Put("safetensors", "seed-0", *a);
  std::ifstream ref("tests/data/muon_v1.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(ref)), std::istreambuf_iterator<char>());
  // The reference file's header and its first tensors (the whole file is megabytes).
  if (bytes.size() > 8) {
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    if (n + 8 <= bytes.size()) Put("safetensors", "seed-header", bytes.substr(0, 8 + n));
  }
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A real generation of each spec that fits in a few KiB: flags 0 (as written: the checksums are
// right), manifest length, manifest, payload.
void CheckpointSeeds(const std::vector<muond::common::JobSpec>& specs) {
  const std::string dir = fs::temp_directory_path() / "muond-make-seeds";
  int n = 0;
  for (const auto& spec : specs) {
    uint64_t elements = 0;
    for (const auto& m : spec.matrices) elements += m.numel();
    if (elements > 2048) continue;
    fs::remove_all(dir);
    muond::server::checkpoint::Store store(dir, 1);
    const size_t arrays = muond::server::checkpoint::StateTensors(spec).size();
    std::vector<int64_t> steps(
        spec.mode == muond::common::JobMode::kApply ? spec.matrices.size() : 0, 3);
    auto info = store.Write(
        spec, 7,
        [&](size_t m, std::vector<float>* out) {
          const auto shape = muond::server::checkpoint::StateTensors(spec)[m].shape;
          int64_t numel = 1;
          for (int64_t d : shape) numel *= d;
          out->assign(numel, 0.25f * static_cast<float>(m + 1));
          return absl::OkStatus();
        },
        steps);
    if (!info.ok() || arrays == 0) {
      std::cerr << "checkpoint seed: " << info.status() << "\n";
      continue;
    }
    const std::string manifest = ReadAll(info->path + "/manifest.json");
    const std::string payload = ReadAll(info->path + "/momentum.safetensors");
    std::string seed(1, '\0');
    const uint32_t len = static_cast<uint32_t>(manifest.size());
    seed.append(reinterpret_cast<const char*>(&len), 4);
    Put("checkpoint", "seed-" + std::to_string(n++), seed + manifest + payload);
  }
  fs::remove_all(dir);
}

void ShmSeeds() {
  muond::v1::ShmAttachRequest req;
  req.set_job_id("llama.7b_run-3");
  req.set_rank(3);
  req.set_token("0123456789abcdef0123456789abcdef");
  req.set_takeover(true);
  std::string l(2, '\0');
  l[0] = 0x00;
  l[1] = 0x01;  // limit 256
  Put("shm_attach", "seed-0", l + req.SerializeAsString());
  // Doorbell: session 5, buffer 4096 bytes, tail 0, then well-formed records.
  std::string d;
  auto u64 = [&](uint64_t v) { d.append(reinterpret_cast<const char*>(&v), 8); };
  u64(5);
  u64(4096);
  u64(0);
  d += std::string(64, '\x01');
  Put("shm_doorbell", "seed-0", d);
}

void ConfigSeeds() {
  Put("daemon_config", "seed-0",
      "# muond.conf\nlisten = unix:///run/muond/muond.sock\nstate-dir = /var/lib/muond\n"
      "threads = 4\nlog-level = info\nmetrics-address = 127.0.0.1:9464\nbackend = cpu\n"
      "gather-budget-bytes = 1073741824\nshutdown-grace-seconds = 30\nmax-connections = 64\n"
      "allow-uids = 0,1000\nallow-groups = muon\nserial-schedule = false\n");
  Put("daemon_config", "seed-1",
      "listen = 0.0.0.0:7070\ninsecure-tcp = true\nbackend = simulated\nsim-copy-gbps = 12.5\n"
      "sim-compute-gflops = 100\nsim-copy-latency-us = 3\nsim-sleep = true\nsim-fail-kernel = 0\n"
      "tls-cert = /etc/muond/cert.pem\ntls-key = /etc/muond/key.pem\nshm-socket = off\n");
}

void HttpSeeds() {
  auto seed = [](const std::string& request) {
    std::string s("\x00\x10", 2);  // max_request_bytes 64 + 4096
    for (size_t at = 0; at < request.size(); at += 20) {
      const std::string piece = request.substr(at, 20);
      s += static_cast<char>(piece.size() - 1);
      s += piece;
    }
    return s;
  };
  Put("metrics_http", "seed-0",
      seed("GET /metrics HTTP/1.1\r\nHost: localhost:9464\r\n"
           "Accept: text/plain\r\n\r\n"));
  Put("metrics_http", "seed-1", seed("HEAD /metrics HTTP/1.0\n\n"));
  Put("metrics_http", "seed-2", seed("POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc"));
  Put("metrics_http", "seed-3", seed("GET /other HTTP/1.1\r\n\r\n"));
}

void ChunkSeeds() {
  std::string s;
  for (int i = 0; i < 64; ++i) s += static_cast<char>(i * 37 + 11);
  Put("grpc_step_chunks", "seed-0", s);
  Put("grpc_step_chunks", "seed-1", std::string(48, '\x02') + std::string(48, '\xfe'));
}

}  // namespace

// Export manifests (ManifestToJson of the exports of the specs; update and apply mode) with the
// fix-up byte set (the harness recomputes the checksum), and one without.
void ExportManifestSeeds(const std::vector<muond::common::JobSpec>& specs) {
  namespace se = muond::common::state_export;
  int n = 0;
  for (const muond::common::JobSpec& spec : specs) {
    se::Manifest m;
    m.job_id = spec.job_id;
    m.mode = spec.mode;
    m.step = 12;
    m.generation = 3;
    m.payload = spec.job_id + se::kPayloadSuffix;
    for (const muond::common::MatrixSpec& t : spec.matrices) {
      se::Array a;
      a.name = spec.mode == muond::common::JobMode::kApply ? "master/" + t.name : t.name;
      a.tensor = t.name;
      a.shape = t.shape;
      a.crc32c = 0x1234u + static_cast<uint32_t>(n);
      m.arrays.push_back(a);
      if (spec.mode == muond::common::JobMode::kApply) m.tensor_steps[t.name] = 12;
    }
    se::LayOut(&m);
    const std::string text = se::ManifestToJson(m);
    Put("export_manifest", "seed-" + std::to_string(n++), std::string(1, '\0') + text);
    Put("export_manifest", "seed-" + std::to_string(n++), std::string(1, '\1') + text);
  }
  Put("export_manifest", "seed-format-1", std::string(1, '\1') + R"({"format": 1})");
  // Rows of a tensor split across nodes (the "rows" field; the harness fixes the checksum).
  se::Manifest rows;
  rows.job_id = "g.node1";
  rows.mode = muond::common::JobMode::kApply;
  rows.payload = "g.node1.safetensors";
  for (const char* name : {"master/embed", "exp_avg/embed", "exp_avg_sq/embed"}) {
    se::Array a{name, "embed", {4, 3}};
    a.row_offset = 2;
    a.full_rows = 9;
    rows.arrays.push_back(a);
  }
  rows.tensor_steps["embed"] = 5;
  se::LayOut(&rows);
  Put("export_manifest", "seed-rows", std::string(1, '\1') + se::ManifestToJson(rows));
  // Compressed state as held: bf16 and int8 (linear and log maps; "map" and "block").
  se::Manifest held;
  held.job_id = "held";
  held.mode = muond::common::JobMode::kApply;
  held.payload = "held.safetensors";
  const muond::common::StateDType kHeld[] = {muond::common::StateDType::kFloat32,
                                             muond::common::StateDType::kBFloat16,
                                             muond::common::StateDType::kInt8};
  int slot = 0;
  for (const char* name : {"master/e", "exp_avg/e", "exp_avg_sq/e"}) {
    se::Array a{name, "e", {3, 2049}};
    a.dtype = kHeld[slot];
    a.non_negative = slot == 2;
    held.arrays.push_back(a);
    ++slot;
  }
  held.tensor_steps["e"] = 2;
  se::LayOut(&held);
  Put("export_manifest", "seed-held", std::string(1, '\1') + se::ManifestToJson(held));
}

// Job records as JobRegistry::Persist writes them (fix-up byte: the directory is named after the
// spec's job id), and reset records as JobRegistry::Reset writes them.
void JobRecordSeeds(const std::vector<muond::common::JobSpec>& specs) {
  using Json = nlohmann::json;
  int n = 0;
  for (const muond::common::JobSpec& spec : specs) {
    const Json record = {{"format", "muond-job"},
                         {"format_version", 1},
                         {"spec", Json::parse(muond::common::JobSpecToJson(spec))},
                         {"token_sha256", std::string(64, 'a')},
                         {"owner", {{"uid", 1000}, {"description", "uid 1000 gid 1000 pid 4242"}}}};
    Put("job_record", "seed-" + std::to_string(n++), "\1" + record.dump(1, ' ') + "\n");
  }
  Put("job_record", "seed-format-7",
      "\1" + Json{{"format", 7}, {"spec", Json::parse(muond::common::JobSpecToJson(specs[0]))}}
                 .dump());
  Put("reset_record", "seed-0",
      Json{{"format", "muond-reset"}, {"next_step", 17}, {"after_generation", 4}}.dump() + "\n");
  Put("reset_record", "seed-1",
      Json{{"format", "muond-reset"}, {"next_step", "17"}, {"after_generation", 4}}.dump());
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_make_seeds CORPUS_DIR\n";
    return 2;
  }
  out_dir = argv[1];
  const auto specs = Specs();
  JobSpecSeeds(specs);
  SafetensorsSeeds();
  CheckpointSeeds(specs);
  ShmSeeds();
  ConfigSeeds();
  HttpSeeds();
  ChunkSeeds();
  ExportManifestSeeds(specs);
  JobRecordSeeds(specs);
  return 0;
}
