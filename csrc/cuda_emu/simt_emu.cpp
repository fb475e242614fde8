// The fiber runtime behind simt_emu.h: a launch runs its CTAs one after another; inside a CTA every
// CUDA thread is a fiber with its own stack, run until it reaches __syncthreads, a warp
// instruction or its end. The scheduler releases a warp instruction when all 32 lanes of the
// warp reached it, and __syncthreads when every thread of the CTA did; anything else is an error
// (divergence or deadlock), reported with the CTA and thread.
//
// Fibers start through makecontext / swapcontext and then switch with _setjmp / _longjmp, which
// skip the signal-mask system call of swapcontext (millions of switches per test).
#undef _FORTIFY_SOURCE  // its longjmp check rejects jumps between fiber stacks
#include "simt_emu.h"

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace chunkattn {
// 227 KB, the most a Hopper block may opt in to, then a guard that must stay untouched.
alignas(16) char smem_raw[simt::kSharedCapacity + simt::kSharedGuard];
}  // namespace chunkattn

namespace simt {

Index3 thread_idx{0, 0, 0}, block_idx{0, 0, 0};

namespace {

constexpr size_t kStackBytes = 128 << 10;
constexpr unsigned char kNanByte = 0xff;  // 0xffff.. is a NaN in fp16, bf16 and fp32
constexpr unsigned char kGuardByte = 0xa5;

enum class Wait { kRunnable, kSyncthreads, kWarp, kDone };

struct PendingCopy {
  void* dst;
  int size;
  unsigned char data[16];
};

struct Fiber {
  ucontext_t start;
  jmp_buf resume;
  bool started = false;
  Wait wait = Wait::kRunnable;
  int warp_phase = 0;  // 1: operands posted, 2: operands read (warp_exchange / warp_done)
  std::vector<char> stack;
  std::vector<PendingCopy> open;                  // issued, not yet committed
  std::deque<std::vector<PendingCopy>> committed;  // cp.async groups, oldest first
};

struct Launch {
  std::vector<Fiber> fibers;
  std::vector<LaneOperands> posted;  // per thread, read by the whole warp
  jmp_buf scheduler;
  ucontext_t scheduler_start;
  int current = 0;
  int smem_bytes = 0;
  bool waited_for_primary_grid = false;  // by a thread of this CTA
  LaunchOptions options;
  const std::function<void()>* kernel = nullptr;
  const std::vector<GlobalRange>* globals = nullptr;
  std::string error;
};

Launch* g = nullptr;

Fiber& current() { return g->fibers[g->current]; }

void yield(Wait w) {
  Fiber& f = current();
  f.wait = w;
  if (!_setjmp(f.resume)) _longjmp(g->scheduler, 1);
}

void fiber_main() {
  (*g->kernel)();
  current().wait = Wait::kDone;
  _longjmp(g->scheduler, 1);
}

void resume(int t) {
  g->current = t;
  thread_idx = {unsigned(t), 0, 0};
  Fiber& f = g->fibers[t];
  if (!_setjmp(g->scheduler)) {
    if (f.started) _longjmp(f.resume, 1);
    f.started = true;
    swapcontext(&g->scheduler_start, &f.start);  // never returns: the fiber jumps back
  }
}

std::string where() {
  return "CTA (" + std::to_string(block_idx.x) + ", " + std::to_string(block_idx.y) + ")";
}

[[noreturn]] void cta_error(const std::string& what) { throw std::runtime_error("SIMT emulation: " + where() + ": " + what); }

// One CTA from start to end; throws on the first error.
void run_cta(std::mt19937& rng) {
  const int n = int(g->fibers.size());
  for (Fiber& f : g->fibers) {
    getcontext(&f.start);
    f.start.uc_stack.ss_sp = f.stack.data();
    f.start.uc_stack.ss_size = f.stack.size();
    f.start.uc_link = nullptr;
    makecontext(&f.start, fiber_main, 0);
    f.started = false;
    f.wait = Wait::kRunnable;
    f.warp_phase = 0;
    f.open.clear();
    f.committed.clear();
  }
  std::memset(chunkattn::smem_raw, kNanByte, g->smem_bytes);
  std::memset(chunkattn::smem_raw + g->smem_bytes, kGuardByte, kSharedGuard);
  g->waited_for_primary_grid = false;
  if (g->options.before_cta) g->options.before_cta();
  const int warps = n / 32;
  std::vector<int> order(n);
  for (int t = 0; t < n; ++t) order[t] = t;
  std::vector<char> runnable(warps), advance(warps);
  for (;;) {
    // Advance the runnable threads of a random nonempty subset of warps, in a random order:
    // warps drift apart as they may on a GPU (a missing __syncthreads shows as a race).
    bool any = false;
    for (int w = 0; w < warps; ++w) {
      runnable[w] = 0;
      for (int l = 0; l < 32; ++l) runnable[w] |= g->fibers[w * 32 + l].wait == Wait::kRunnable;
      any = any || runnable[w];
    }
    if (any) {
      bool chosen = false;
      while (!chosen)
        for (int w = 0; w < warps; ++w) {
          advance[w] = runnable[w] && rng() % 2 == 0;
          chosen = chosen || advance[w];
        }
      std::shuffle(order.begin(), order.end(), rng);
      for (int t : order)
        if (advance[t / 32] && g->fibers[t].wait == Wait::kRunnable) {
          resume(t);
          if (!g->error.empty()) cta_error(g->error);
        }
    }
    bool waiting_warp = false;  // a warp not yet resolved: runnable lanes, or just released
    for (int w = 0; w < warps; ++w) {
      int at_warp = 0, phase = 0, still_runnable = 0;
      for (int l = 0; l < 32; ++l) {
        const Fiber& f = g->fibers[w * 32 + l];
        still_runnable += f.wait == Wait::kRunnable;
        if (f.wait != Wait::kWarp) continue;
        if (at_warp++ == 0) phase = f.warp_phase;
        if (f.warp_phase != phase) cta_error("warp " + std::to_string(w) + ": lanes at different warp instructions");
      }
      if (still_runnable > 0) {
        waiting_warp = true;
        continue;
      }
      if (at_warp == 0) continue;
      if (at_warp < 32)
        cta_error("warp " + std::to_string(w) + ": only " + std::to_string(at_warp) +
                  " of 32 lanes reached a warp instruction (divergent warp)");
      for (int l = 0; l < 32; ++l) g->fibers[w * 32 + l].wait = Wait::kRunnable;
      waiting_warp = true;
    }
    if (waiting_warp) continue;
    int done = 0;
    for (const Fiber& f : g->fibers) done += f.wait == Wait::kDone;
    if (done == n) break;
    if (done > 0) cta_error("__syncthreads reached after " + std::to_string(done) + " threads exited");
    for (Fiber& f : g->fibers) f.wait = Wait::kRunnable;  // all n at __syncthreads
  }
  for (int t = 0; t < n; ++t)
    if (!g->fibers[t].open.empty() || !g->fibers[t].committed.empty())
      cta_error("thread " + std::to_string(t) + " ended with cp.async copies never waited for");
  for (int i = 0; i < kSharedGuard; ++i)
    if (static_cast<unsigned char>(chunkattn::smem_raw[g->smem_bytes + i]) != kGuardByte)
      cta_error("shared memory written past the launch's " + std::to_string(g->smem_bytes) + " bytes");
}

}  // namespace

void fail(const char* what) {
  if (g->error.empty()) g->error = "thread " + std::to_string(g->current) + ": " + what;
  _longjmp(g->scheduler, 1);
}

const LaneOperands* warp_exchange(const LaneOperands& mine) {
  const int t = g->current, w = t / 32;
  g->posted[t] = mine;
  current().warp_phase = 1;
  yield(Wait::kWarp);
  const LaneOperands* all = &g->posted[w * 32];
  for (int l = 0; l < 32; ++l)
    if (all[l].op != mine.op) fail("lanes of one warp reached different warp instructions");
  return all;
}

void warp_done() {
  current().warp_phase = 2;
  yield(Wait::kWarp);
}

void syncthreads() { yield(Wait::kSyncthreads); }

void check_shared(const void* p, int bytes, int align, const char* what) {
  const char* c = static_cast<const char*>(p);
  if (c < chunkattn::smem_raw || c + bytes > chunkattn::smem_raw + g->smem_bytes) {
    const std::string msg = std::string(what) + " outside the launch's shared memory (offset " +
                            std::to_string(c - chunkattn::smem_raw) + ", " + std::to_string(g->smem_bytes) +
                            " bytes)";
    fail(msg.c_str());
  }
  if (reinterpret_cast<uintptr_t>(p) % align != 0) fail((std::string(what) + " misaligned").c_str());
}

void check_global(const void* p, int bytes, int align, const char* what) {
  const char* c = static_cast<const char*>(p);
  bool inside = false;
  for (const GlobalRange& r : *g->globals) {
    const char* b = static_cast<const char*>(r.begin);
    inside = inside || (c >= b && c + bytes <= b + r.bytes);
  }
  if (!inside) fail((std::string(what) + " outside every tensor of the call").c_str());
  if (reinterpret_cast<uintptr_t>(p) % align != 0) fail((std::string(what) + " misaligned").c_str());
}

void cp_async(void* dst, const void* src, int size, int src_bytes) {
  if (size != 4 && size != 8 && size != 16) fail("cp.async cp-size not 4, 8 or 16");
  check_shared(dst, size, size, "cp.async destination");
  if (src_bytes < 0 || src_bytes > size) fail("cp.async src-size not in [0, cp-size]");
  PendingCopy c{dst, size, {}};
  if (src_bytes > 0) {
    check_global(src, src_bytes, size, "cp.async source");
    std::memcpy(c.data, src, src_bytes);
  }
  if (g->options.cp_async_lands_at_issue) std::memcpy(dst, c.data, size);
  else current().open.push_back(c);
}

void cp_async_commit() {
  Fiber& f = current();
  f.committed.push_back(std::move(f.open));
  f.open.clear();
}

void cp_async_wait(int pending) {
  Fiber& f = current();
  while (int(f.committed.size()) > pending) {
    for (const PendingCopy& c : f.committed.front()) std::memcpy(c.dst, c.data, c.size);
    f.committed.pop_front();
  }
}

void wait_for_primary_grid() {
  if (!g->waited_for_primary_grid && g->options.primary_grid_done) g->options.primary_grid_done();
  g->waited_for_primary_grid = true;
}

void launch(int grid_x, int grid_y, int threads, int smem_bytes, const std::function<void()>& kernel,
            const std::vector<GlobalRange>& globals, const LaunchOptions& options) {
  if (threads <= 0 || threads % 32 != 0 || threads > 1024) throw std::runtime_error("SIMT emulation: bad block size");
  if (smem_bytes > kSharedCapacity)
    throw std::runtime_error("SIMT emulation: " + std::to_string(smem_bytes) +
                             " bytes of shared memory per block; no GPU gives more than " +
                             std::to_string(kSharedCapacity));
  Launch launch;
  launch.fibers.resize(threads);
  for (Fiber& f : launch.fibers) f.stack.resize(kStackBytes);
  launch.posted.resize(threads);
  launch.smem_bytes = smem_bytes;
  launch.options = options;
  launch.kernel = &kernel;
  launch.globals = &globals;
  // CTAs in a random order: the kernel may not rely on any.
  std::mt19937 rng(options.seed);
  std::vector<int> ctas(int64_t(grid_x) * grid_y);
  for (size_t i = 0; i < ctas.size(); ++i) ctas[i] = int(i);
  std::shuffle(ctas.begin(), ctas.end(), rng);
  g = &launch;
  try {
    for (int c : ctas) {
      block_idx = {unsigned(c % grid_x), unsigned(c / grid_x), 0};
      run_cta(rng);
    }
  } catch (...) {
    g = nullptr;
    throw;
  }
  g = nullptr;
}

}  // namespace simt
