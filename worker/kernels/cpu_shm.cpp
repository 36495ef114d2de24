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

#include <chrono>
#include <cstdint>
#include <cstring>
#include <ctime>

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

// x = slot 0 + slot 1 + ... in rank order, so every rank gets the same bits.
void reduce_into(const at::Tensor& x, int64_t base, int64_t world, int64_t max_bytes, int64_t seq) {
  const int64_t n = x.numel();
  if (x.scalar_type() == at::kFloat) {
    float* out = x.data_ptr<float>();
    const float* s0 = reinterpret_cast<const float*>(slot_of(base, world, max_bytes, seq, 0));
    const float* s1 = reinterpret_cast<const float*>(slot_of(base, world, max_bytes, seq, 1));
    for (int64_t i = 0; i < n; ++i) out[i] = s0[i] + s1[i];
    for (int64_t r = 2; r < world; ++r) {
      const float* s = reinterpret_cast<const float*>(slot_of(base, world, max_bytes, seq, r));
      for (int64_t i = 0; i < n; ++i) out[i] += s[i];
    }
    return;
  }
  // Other dtypes: torch's own add over views of the slots (the same order).
  auto slot = [&](int64_t r) {
    return at::from_blob(slot_of(base, world, max_bytes, seq, r), x.sizes(), x.options());
  };
  x.copy_(slot(0));
  for (int64_t r = 1; r < world; ++r) x.add_(slot(r));
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
  if (publish) {
    std::memcpy(slot_of(base, world, max_bytes, seq, rank), x.data_ptr(), nbytes);
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
  if (reduce) reduce_into(x, base, world, max_bytes, seq);
  return true;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("shm_collective(Tensor(a!) x, int base, int rank, int world_size, int max_bytes, int seq, bool publish, "
        "bool reduce, float spin_s, float wait_s) -> bool");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) { m.impl("shm_collective", &shm_collective); }
