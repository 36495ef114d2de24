// One collective step of worker/comm/shm_allreduce.py's protocol, in compiled code.
//
// Why: on a small model a tensor-parallel decode step issues 2 * num_layers + 1 collectives of a
// few kilobytes each, so their fixed cost is the step's communication cost. The Python version
// spends ~15-30 us a call in the interpreter (views, a futex-wake syscall every time, polling
// through a memoryview) and more when a peer is late; here a call is a copy into this rank's
// slot, one atomic store, a spin on the peers' flags with `pause`, and a vectorised sum.
//
// Segment layout (shared with the Python version; worker/comm/shm_allreduce.py explains the
// protocol and why double buffering makes one wait per collective enough):
//   base + r * 64:        int64 flag of rank r (the last collective it published)
//   base + r * 64 + 8:    int32 count of ranks sleeping on that flag (this file's addition)
//   base + world * 64:    2 buffers x world slots x max_bytes
//
// Waking: a publisher calls FUTEX_WAKE only when some rank sleeps on its flag, so the common case
// (every rank on its own core, arriving within the spin) makes no system call at all. The sleeper
// raises the count before it re-reads the flag and the publisher reads the count after it stores
// the flag, both sequentially consistent, so at least one of them sees the other (Dekker): either
// the sleeper sees the new flag and does not sleep, or the publisher sees the sleeper and wakes it.
// FUTEX_WAIT compares the flag word in the kernel, so a store between the check and the sleep
// makes the wait return at once instead of losing the wake.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include <signal.h>

#include "shm_collective.h"

namespace {

constexpr int64_t kFlagStride = 64;

using Clock = std::chrono::steady_clock;

int64_t* flag_of(int64_t base, int64_t r) { return reinterpret_cast<int64_t*>(base + r * kFlagStride); }
int32_t* sleepers_of(int64_t base, int64_t r) { return reinterpret_cast<int32_t*>(base + r * kFlagStride + 8); }
char* slot_of(int64_t base, int64_t world, int64_t max_bytes, int64_t seq, int64_t r) {
  return reinterpret_cast<char*>(base + world * kFlagStride + ((seq & 1) * world + r) * max_bytes);
}

long futex(void* word, int op, int value, const timespec* timeout) {
  return syscall(SYS_futex, word, op, value, timeout, nullptr, 0);
}

// Wait until rank r's flag reaches seq: spin for spin_s, then sleep on the flag until `deadline`.
bool wait_for(int64_t base, int64_t r, int64_t seq, Clock::time_point spin_until, Clock::time_point deadline) {
  int64_t* flag = flag_of(base, r);
  for (int polls = 0;; ++polls) {
    if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= seq) return true;
    _mm_pause();
    if ((polls & 63) == 63 && Clock::now() >= spin_until) break;
  }
  int32_t* sleepers = sleepers_of(base, r);
  while (true) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    __atomic_add_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
    const int64_t seen = __atomic_load_n(flag, __ATOMIC_SEQ_CST);
    if (seen < seq) {
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count();
      const timespec timeout{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
      // The flag's low 32 bits are its futex word (x86-64 is little-endian).
      futex(flag, FUTEX_WAIT, static_cast<int32_t>(seen & 0xFFFFFFFF), &timeout);
    }
    __atomic_sub_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= seq) return true;
  }
}

// out (n floats) = slot 0 + slot 1 + ... in rank order, so every rank gets the same bits.
void reduce_floats(float* out, int64_t n, int64_t base, int64_t world, int64_t max_bytes, int64_t seq) {
  const float* s0 = reinterpret_cast<const float*>(slot_of(base, world, max_bytes, seq, 0));
  const float* s1 = reinterpret_cast<const float*>(slot_of(base, world, max_bytes, seq, 1));
  for (int64_t i = 0; i < n; ++i) out[i] = s0[i] + s1[i];
  for (int64_t r = 2; r < world; ++r) {
    const float* s = reinterpret_cast<const float*>(slot_of(base, world, max_bytes, seq, r));
    for (int64_t i = 0; i < n; ++i) out[i] += s[i];
  }
}

// x = slot 0 + slot 1 + ... in rank order (float32: reduce_floats; other dtypes: torch's add over views).
void reduce_into(const at::Tensor& x, int64_t base, int64_t world, int64_t max_bytes, int64_t seq) {
  if (x.scalar_type() == at::kFloat) {
    reduce_floats(x.data_ptr<float>(), x.numel(), base, world, max_bytes, seq);
    return;
  }
  auto slot = [&](int64_t r) {
    return at::from_blob(slot_of(base, world, max_bytes, seq, r), x.sizes(), x.options());
  };
  x.copy_(slot(0));
  for (int64_t r = 1; r < world; ++r) x.add_(slot(r));
}

// Publish `nbytes` of data as this rank's part of collective `seq` (publish: false when resuming a wait), then wait
// up to wait_s seconds for every peer, spinning for the first spin_s. Returns whether every peer arrived.
bool publish_and_wait(const void* data, int64_t nbytes, int64_t base, int64_t rank, int64_t world, int64_t max_bytes,
                      int64_t seq, bool publish, double spin_s, double wait_s) {
  if (publish) {
    std::memcpy(slot_of(base, world, max_bytes, seq, rank), data, nbytes);
    __atomic_store_n(flag_of(base, rank), seq, __ATOMIC_SEQ_CST);  // after the data
    if (__atomic_load_n(sleepers_of(base, rank), __ATOMIC_SEQ_CST) > 0) {
      futex(flag_of(base, rank), FUTEX_WAKE, 0x7FFFFFFF, nullptr);
    }
  }
  const auto start = Clock::now();
  const auto spin_until = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(spin_s));
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wait_s));
  for (int64_t r = 0; r < world; ++r) {
    if (r != rank && !wait_for(base, r, seq, spin_until, deadline)) return false;
  }
  return true;
}

// Whether process pid runs (an exited process not yet reaped is a zombie: dead), as shm_allreduce.py's _alive.
bool alive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr) return errno != ENOENT;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');
  return paren == nullptr || paren[1] == 0 || paren[2] != 'Z';
}

// One collective (number `seq`) for this rank. publish: copy x into this rank's slot and publish
// the flag (false when resuming a wait that timed out). Then wait for every peer for up to
// wait_s seconds, spinning for the first spin_s. On success, with reduce, x holds the sum over
// the ranks; returns whether every peer arrived (false: the caller checks liveness and calls
// again with publish = false, or gives up).
bool shm_collective(const at::Tensor& x, int64_t base, int64_t rank, int64_t world, int64_t max_bytes, int64_t seq,
                    bool publish, bool reduce, double spin_s, double wait_s) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "tpserve shm_collective: x must be a contiguous CPU tensor");
  TORCH_CHECK(0 <= rank && rank < world && world >= 2, "tpserve shm_collective: bad rank ", rank, " of ", world);
  const int64_t nbytes = x.numel() * x.element_size();
  TORCH_CHECK(nbytes <= max_bytes, "tpserve shm_collective: ", nbytes, " bytes exceed the slot's ", max_bytes);
  if (!publish_and_wait(x.data_ptr(), nbytes, base, rank, world, max_bytes, seq, publish, spin_s, wait_s)) return false;
  if (reduce) reduce_into(x, base, world, max_bytes, seq);
  return true;
}

}  // namespace

namespace tpserve {

std::string shm_all_reduce(float* x, int64_t n, const ShmGroup& g, int64_t seq) {
  const int64_t nbytes = n * static_cast<int64_t>(sizeof(float));
  if (nbytes > g.max_bytes) {
    return "tpserve shm all-reduce: " + std::to_string(nbytes) + " bytes exceed the slot's " +
           std::to_string(g.max_bytes);
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(g.timeout_s));
  bool publish = true;
  // Each call waits at most sleep_s, so the liveness and timeout checks run between calls (shm_allreduce.py).
  while (!publish_and_wait(x, nbytes, g.base, g.rank, g.world, g.max_bytes, seq, publish, g.spin_s, g.sleep_s)) {
    publish = false;
    std::string late, exited;
    for (int64_t r = 0; r < g.world; ++r) {
      if (__atomic_load_n(flag_of(g.base, r), __ATOMIC_ACQUIRE) >= seq) continue;
      late += (late.empty() ? "" : ", ") + std::to_string(r);
      if (!g.peer_pids.empty() && !alive(g.peer_pids[r])) exited += (exited.empty() ? "" : ", ") + std::to_string(r);
    }
    const std::string where = " shared-memory collective " + std::to_string(seq) + " (rank " + std::to_string(g.rank) +
                              ")";
    if (!exited.empty()) return "ranks [" + exited + "] exited during" + where;
    if (!late.empty() && Clock::now() > deadline) {
      char timeout[32];
      std::snprintf(timeout, sizeof timeout, "%.1f", g.timeout_s);
      return std::string("Timed out after ") + timeout + " s waiting for ranks [" + late + "] in" + where;
    }
  }
  reduce_floats(x, n, g.base, g.world, g.max_bytes, seq);
  return "";
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("shm_collective(Tensor(a!) x, int base, int rank, int world_size, int max_bytes, int seq, bool publish, "
        "bool reduce, float spin_s, float wait_s) -> bool");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) { m.impl("shm_collective", &shm_collective); }
