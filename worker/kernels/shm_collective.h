// The shared-memory all-reduce of worker/comm/shm_allreduce.py's protocol (cpu_shm.cpp), for compiled callers: the
// decode region (cpu_decode_region.cpp) sums its tensor-parallel partial products here, between two barriers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tpserve {

// One host's tensor-parallel group as worker/comm/shm_allreduce.py's SharedMemoryComm maps it.
struct ShmGroup {
  int64_t base;       // the segment's address in this process
  int64_t rank, world;
  int64_t max_bytes;  // bytes per slot
  double spin_s;      // seconds spent spinning on a late peer's flag before sleeping on it
  double sleep_s;     // longest sleep between the liveness and timeout checks
  double timeout_s;   // seconds a collective waits for its peers
  std::vector<int64_t> peer_pids;  // each rank's pid (empty: the timeout alone notices a lost peer)
};

// x (n float32) summed over the group's ranks in rank order, in place, as collective number seq: the same bits as
// SharedMemoryComm.all_reduce. Returns "" or the error SharedMemoryComm raises (a peer exited, the timeout passed,
// x larger than a slot).
std::string shm_all_reduce(float* x, int64_t n, const ShmGroup& group, int64_t seq);

}  // namespace tpserve
