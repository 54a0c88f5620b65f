// widen: the CUDA built-ins the CUDA dialect uses, for running its kernels on
// the CPU (docs/architecture.md §6, "The CUDA dialect on the CPU").
//
// Execution model. A launch runs its blocks one after another on the calling
// OS thread. Each CUDA thread of a block is a fiber with a stack of its own
// (switched by a few instructions on x86-64 Linux, by ucontext elsewhere); a
// scheduler resumes the block's live fibers round-robin, in lane order or in
// reverse lane order (the launch's `order`), and a fiber runs
// until it reaches a barrier or returns. `__syncthreads()` waits until every
// live thread of the block has arrived, `__syncwarp()` and the shuffles until
// every live lane of the warp has. So all lanes of a block run up to a
// barrier before any runs past it, and between barriers they run one after
// another, first to last or last to first: a barrier the kernel needs but
// lacks shows as a wrong result in one of the two orders. A barrier some
// threads never reach (a divergent barrier) leaves the scheduler with no
// fiber to resume; the launch then stops and reports it.
//
// `__shared__` variables are function `static`s: one instance, shared by
// the fibers of the block that runs; blocks run one at a time, and launches of
// one module from several OS threads take turns (a lock per module). A thread
// that returned no longer counts at barriers (as on the GPU).
//
// Not modelled: warp-synchronous execution without `__syncwarp` or a shuffle
// (lanes of a warp run one after another here, not in lock step), partial
// shuffle masks (rejected), atomics, dynamic shared memory, 2-D and 3-D
// launches, and the device math library's accuracy (`expf` and friends are the
// host's). With -fsanitize=thread the fibers are ThreadSanitizer fibers that
// synchronise only at barriers, so a missing barrier is also reported as a race.
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <mutex>
#include <utility>

#if defined(__SANITIZE_THREAD__)
#define WIDEN_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define WIDEN_EMU_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define WIDEN_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define WIDEN_EMU_ASAN 1
#endif
#endif

#if defined(WIDEN_EMU_TSAN)
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
// The emulator's own bookkeeping is not instrumented: only the kernels'
// accesses are checked, and they synchronise only at barriers.
#define WIDEN_EMU_INTERNAL __attribute__((no_sanitize("thread"), noinline))
#else
#define WIDEN_EMU_INTERNAL inline
#endif
#if defined(WIDEN_EMU_ASAN)
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, size_t* size_old);
}
#endif

// Switching between fibers. On x86-64 Linux a few instructions that save the
// callee-saved registers and the floating-point control words and swap stack
// pointers (ucontext's swapcontext makes a system call per switch, about 20
// times slower); elsewhere ucontext.
#if defined(__x86_64__) && defined(__linux__) && !defined(WIDEN_EMU_UCONTEXT)
#define WIDEN_EMU_ASM_SWITCH 1
extern "C" void widen_emu_switch(void** save_sp, void* load_sp);
__asm__(
    ".text\n"
    ".globl widen_emu_switch\n"
    ".hidden widen_emu_switch\n"
    ".type widen_emu_switch, @function\n"
    "widen_emu_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    subq $8, %rsp\n"
    "    stmxcsr (%rsp)\n"
    "    fnstcw 4(%rsp)\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    ldmxcsr (%rsp)\n"
    "    fldcw 4(%rsp)\n"
    "    addq $8, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size widen_emu_switch, .-widen_emu_switch\n");
#endif

namespace widen_emu {
// Internal linkage: each module has its own lock and state, even where
// several are loaded into one process.
namespace {

struct Dim3 {
    unsigned int x, y, z;
};

const unsigned int WARP = 32;
const unsigned int MAX_THREADS = 1024;
const unsigned int FULL_MASK = 0xffffffffu;

// Bytes of stack per fiber (plus a guard page below it).
#if defined(WIDEN_EMU_TSAN) || defined(WIDEN_EMU_ASAN)
const size_t STACK_BYTES = 1u << 20;
#else
const size_t STACK_BYTES = 256u << 10;
#endif

enum Wait { RUNNABLE = 0, AT_BLOCK_BARRIER = 1, AT_WARP_BARRIER = 2, DONE = 3 };

// A saved execution context.
struct Context {
#if defined(WIDEN_EMU_ASM_SWITCH)
    void* sp;
#else
    ucontext_t uc;
#endif
};

WIDEN_EMU_INTERNAL void switch_context(Context* save, Context* load) {
#if defined(WIDEN_EMU_ASM_SWITCH)
    widen_emu_switch(&save->sp, load->sp);
#else
    swapcontext(&save->uc, &load->uc);
#endif
}

// Prepares `c` to start `entry` (which never returns) on the stack `[stack, stack + bytes)`.
WIDEN_EMU_INTERNAL bool make_context(Context* c, char* stack, size_t bytes, void (*entry)()) {
#if defined(WIDEN_EMU_ASM_SWITCH)
    uintptr_t top = ((uintptr_t)(stack + bytes)) & ~(uintptr_t)15;
    uint64_t* sp = (uint64_t*)top;
    *--sp = 0;                   // where `entry`'s return address would be: rsp = 8 mod 16 on entry
    *--sp = (uint64_t)entry;     // popped by `ret`
    for (int r = 0; r < 6; ++r) {
        *--sp = 0;               // rbp, rbx, r12..r15
    }
    *--sp = 0x037f00001f80ull;   // MXCSR (default) and the x87 control word (default)
    c->sp = sp;
    return true;
#else
    if (getcontext(&c->uc) != 0) {
        return false;
    }
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = bytes;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
    return true;
#endif
}

struct Fiber {
    Context ctx;
    char* stack;  // lowest usable byte (the guard page lies below)
    unsigned int lane;
    int wait;
#if defined(WIDEN_EMU_TSAN)
    void* tsan;
#endif
#if defined(WIDEN_EMU_ASAN)
    void* fake_stack;
#endif
};

struct Warp {
    unsigned int live;        // lanes not returned
    unsigned int arrived;     // lanes at the warp barrier
    unsigned int generation;  // warp barriers released so far
    uint64_t slot[WARP];   // shuffle exchange
};

// The state of the launch running on this OS thread.
struct Launch {
    Dim3 grid, block, block_idx;
    Fiber* fibers;
    unsigned int threads;
    Fiber* current;
    Context scheduler;
    void (*body)(void*);
    void* arg;
    unsigned int live, arrived;  // threads of the block not returned, at the block barrier
    unsigned int block_generation;  // block barriers released so far
    Warp warps[MAX_THREADS / WARP];
    char error[256];
#if defined(WIDEN_EMU_TSAN)
    void* tsan_scheduler;
    // Addresses for the annotations: the start of a block, and the barriers
    // by the parity of their generation (a lane released from one barrier
    // must not acquire what the lanes that ran ahead released at the next).
    char block_start, block_sync[2], warp_sync[MAX_THREADS / WARP][2];
#endif
#if defined(WIDEN_EMU_ASAN)
    const void* scheduler_stack;
    size_t scheduler_stack_size;
#endif
};

inline Launch*& launch_slot() {
    static thread_local Launch* launch = nullptr;
    return launch;
}

inline char* last_error() {
    static thread_local char error[256];
    return error;
}

// Fiber stacks, kept for the OS thread's next launches (mapping and first
// touching them costs more than a small launch): `count` stacks of
// STACK_BYTES, each above a guard page, so an overflow faults instead of
// writing into a neighbour.
const size_t GUARD_BYTES = 4096;

struct StackPool {
    char* base = nullptr;
    unsigned int count = 0;

    WIDEN_EMU_INTERNAL char* reserve(unsigned int n) {
        if (n <= count) {
            return base;
        }
        release();
        size_t bytes = (size_t)n * (STACK_BYTES + GUARD_BYTES);
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            return nullptr;
        }
        base = (char*)p;
        count = n;
        for (unsigned int t = 0; t < n; ++t) {
            mprotect(base + t * (STACK_BYTES + GUARD_BYTES), GUARD_BYTES, PROT_NONE);
        }
        return base;
    }

    WIDEN_EMU_INTERNAL void release() {
        if (base != nullptr) {
            munmap(base, (size_t)count * (STACK_BYTES + GUARD_BYTES));
        }
        base = nullptr;
        count = 0;
    }

    ~StackPool() { release(); }
};

inline StackPool& stack_pool() {
    static thread_local StackPool pool;
    return pool;
}

WIDEN_EMU_INTERNAL Dim3 thread_idx() {
    return Dim3{launch_slot()->current->lane, 0, 0};
}

WIDEN_EMU_INTERNAL Dim3 block_idx() {
    return launch_slot()->block_idx;
}

WIDEN_EMU_INTERNAL Dim3 block_dim() {
    return launch_slot()->block;
}

WIDEN_EMU_INTERNAL Dim3 grid_dim() {
    return launch_slot()->grid;
}

WIDEN_EMU_INTERNAL void fail(const char* what) {
    Launch* l = launch_slot();
    if (l->error[0] == 0) {
        snprintf(l->error, sizeof l->error, "block %u, thread %u: %s", l->block_idx.x, l->current->lane, what);
    }
}

// Back to the scheduler; returns when the scheduler resumes this fiber.
WIDEN_EMU_INTERNAL void yield_to_scheduler() {
    Launch* l = launch_slot();
    Fiber* f = l->current;
#if defined(WIDEN_EMU_TSAN)
    // With synchronisation: the scheduler (and so the next block) sees this fiber's past.
    __tsan_switch_to_fiber(l->tsan_scheduler, 0);
#endif
#if defined(WIDEN_EMU_ASAN)
    __sanitizer_start_switch_fiber(f->wait == DONE ? nullptr : &f->fake_stack, l->scheduler_stack,
                                   l->scheduler_stack_size);
#endif
    switch_context(&f->ctx, &l->scheduler);
#if defined(WIDEN_EMU_ASAN)
    __sanitizer_finish_switch_fiber(f->fake_stack, &l->scheduler_stack, &l->scheduler_stack_size);
#endif
}

// Releases the block barrier once every live thread has arrived.
WIDEN_EMU_INTERNAL void release_block(Launch* l) {
    if (l->arrived == 0 || l->arrived < l->live) {
        return;
    }
    for (unsigned int t = 0; t < l->threads; ++t) {
        if (l->fibers[t].wait == AT_BLOCK_BARRIER) {
            l->fibers[t].wait = RUNNABLE;
        }
    }
    l->arrived = 0;
    l->block_generation += 1;
}

WIDEN_EMU_INTERNAL void release_warp(Launch* l, unsigned int w) {
    Warp& warp = l->warps[w];
    if (warp.arrived == 0 || warp.arrived < warp.live) {
        return;
    }
    unsigned int end = (w + 1) * WARP < l->threads ? (w + 1) * WARP : l->threads;
    for (unsigned int t = w * WARP; t < end; ++t) {
        if (l->fibers[t].wait == AT_WARP_BARRIER) {
            l->fibers[t].wait = RUNNABLE;
        }
    }
    warp.arrived = 0;
    warp.generation += 1;
}

WIDEN_EMU_INTERNAL void sync_block() {
    Launch* l = launch_slot();
    Fiber* f = l->current;
#if defined(WIDEN_EMU_TSAN)
    char* sync = &l->block_sync[l->block_generation & 1];
    __tsan_release(sync);
#endif
    f->wait = AT_BLOCK_BARRIER;
    l->arrived += 1;
    release_block(l);
    yield_to_scheduler();
#if defined(WIDEN_EMU_TSAN)
    __tsan_acquire(sync);
#endif
}

WIDEN_EMU_INTERNAL void sync_warp(unsigned int mask) {
    Launch* l = launch_slot();
    Fiber* f = l->current;
    if (mask != FULL_MASK) {
        fail("a warp barrier or shuffle with a partial mask (only full masks are emulated)");
    }
    unsigned int w = f->lane / WARP;
#if defined(WIDEN_EMU_TSAN)
    char* sync = &l->warp_sync[w][l->warps[w].generation & 1];
    __tsan_release(sync);
#endif
    f->wait = AT_WARP_BARRIER;
    l->warps[w].arrived += 1;
    release_warp(l, w);
    yield_to_scheduler();
#if defined(WIDEN_EMU_TSAN)
    __tsan_acquire(sync);
#endif
}

// One shuffle: every lane deposits `v`, then reads the lane `source(lane)`
// chose (its own value where that lies outside the lane's segment of `width`).
template <class T, class Source>
WIDEN_EMU_INTERNAL T shuffle(unsigned int mask, T v, int width, Source source) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "shuffles move at most 8 bytes");
    Launch* l = launch_slot();
    unsigned int lane = l->current->lane;
    Warp& warp = l->warps[lane / WARP];
    unsigned int in_warp = lane % WARP;
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    warp.slot[in_warp] = bits;
    sync_warp(mask);
    int w = width > 0 && width <= (int)WARP ? width : (int)WARP;
    int base = (int)in_warp / w * w;
    int from = source((int)in_warp - base, w);
    T out = v;
    if (from >= 0 && from < w) {
        memcpy(&out, &warp.slot[base + from], sizeof(T));
    }
    sync_warp(mask);
    return out;
}

WIDEN_EMU_INTERNAL void fiber_main() {
    Launch* l = launch_slot();
    Fiber* f = l->current;
#if defined(WIDEN_EMU_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &l->scheduler_stack, &l->scheduler_stack_size);
#endif
#if defined(WIDEN_EMU_TSAN)
    // The launch's inputs and the blocks before, not the other lanes' work.
    __tsan_acquire(&l->block_start);
#endif
    l->body(l->arg);
    l = launch_slot();
    f->wait = DONE;
    l->live -= 1;
    l->warps[f->lane / WARP].live -= 1;
    release_block(l);
    release_warp(l, f->lane / WARP);
    yield_to_scheduler();
    abort();  // a finished fiber is never resumed
}

WIDEN_EMU_INTERNAL bool start_fiber(Launch* l, Fiber* f) {
    if (!make_context(&f->ctx, f->stack, STACK_BYTES, fiber_main)) {
        return false;
    }
    f->wait = RUNNABLE;
    (void)l;
    return true;
}

WIDEN_EMU_INTERNAL void resume(Launch* l, Fiber* f) {
    l->current = f;
#if defined(WIDEN_EMU_TSAN)
    // Without synchronisation: lanes order their accesses only through the
    // barrier annotations (and the start of the block, see `fiber_main`).
    __tsan_switch_to_fiber(f->tsan, 1u);
#endif
#if defined(WIDEN_EMU_ASAN)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f->stack, STACK_BYTES);
#endif
    switch_context(&l->scheduler, &f->ctx);
#if defined(WIDEN_EMU_ASAN)
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

// Runs `body` as a launch of `grid` blocks of `block` threads; `order` 0 runs
// the lanes of a block first to last, 1 last to first. Returns 0, or -1 with
// the reason in `last_error()`.
WIDEN_EMU_INTERNAL int launch(unsigned int grid, unsigned int block, int order, void (*body)(void*), void* arg) {
    char* error = last_error();
    error[0] = 0;
    if (block == 0 || block > MAX_THREADS || grid == 0) {
        snprintf(error, 256, "launch of %u blocks of %u threads: CUDA allows 1..=%u threads", grid, block,
                 MAX_THREADS);
        return -1;
    }
    if (launch_slot() != nullptr) {
        snprintf(error, 256, "a kernel launched from inside a kernel");
        return -1;
    }
    Launch* l = (Launch*)calloc(1, sizeof(Launch));
    Fiber* fibers = (Fiber*)calloc(block, sizeof(Fiber));
    char* stacks = stack_pool().reserve(block);
    if (l == nullptr || fibers == nullptr || stacks == nullptr) {
        snprintf(error, 256, "out of memory for %u fibers", block);
        free(l);
        free(fibers);
        return -1;
    }
    l->grid = Dim3{grid, 1, 1};
    l->block = Dim3{block, 1, 1};
    l->fibers = fibers;
    l->threads = block;
    l->body = body;
    l->arg = arg;
#if defined(WIDEN_EMU_TSAN)
    l->tsan_scheduler = __tsan_get_current_fiber();
#endif
    for (unsigned int t = 0; t < block; ++t) {
        fibers[t].stack = stacks + t * (STACK_BYTES + GUARD_BYTES) + GUARD_BYTES;
        fibers[t].lane = t;
#if defined(WIDEN_EMU_TSAN)
        fibers[t].tsan = __tsan_create_fiber(0);
#endif
    }
    static std::mutex one_at_a_time;  // shared memory is one instance per module
    std::lock_guard<std::mutex> turn(one_at_a_time);
    launch_slot() = l;
    int status = 0;
    for (unsigned int b = 0; b < grid && status == 0; ++b) {
        l->block_idx = Dim3{b, 0, 0};
#if defined(WIDEN_EMU_TSAN)
        __tsan_release(&l->block_start);
#endif
        l->live = block;
        l->arrived = 0;
        for (unsigned int w = 0; w * WARP < block; ++w) {
            unsigned int end = (w + 1) * WARP < block ? (w + 1) * WARP : block;
            l->warps[w].live = end - w * WARP;
            l->warps[w].arrived = 0;
        }
        for (unsigned int t = 0; t < block; ++t) {
            if (!start_fiber(l, &fibers[t])) {
                snprintf(l->error, sizeof l->error, "cannot make a fiber context");
                status = -1;
                break;
            }
        }
        while (status == 0 && l->live > 0) {
            bool progressed = false;
            for (unsigned int i = 0; i < block; ++i) {
                Fiber* f = &fibers[order == 1 ? block - 1 - i : i];
                if (f->wait == RUNNABLE) {
                    resume(l, f);
                    progressed = true;
                }
            }
            if (l->error[0] != 0) {
                status = -1;
            } else if (!progressed) {
                unsigned int at_block = 0, at_warp = 0;
                for (unsigned int t = 0; t < block; ++t) {
                    at_block += fibers[t].wait == AT_BLOCK_BARRIER;
                    at_warp += fibers[t].wait == AT_WARP_BARRIER;
                }
                snprintf(l->error, sizeof l->error,
                         "block %u: deadlock, %u threads wait at __syncthreads and %u at a warp barrier "
                         "(a barrier not every thread reaches)",
                         b, at_block, at_warp);
                status = -1;
            }
        }
    }
    if (status != 0) {
        memcpy(error, l->error, sizeof l->error);
        error[255] = 0;
    }
    launch_slot() = nullptr;
#if defined(WIDEN_EMU_TSAN)
    for (unsigned int t = 0; t < block; ++t) {
        __tsan_destroy_fiber(fibers[t].tsan);
    }
#endif
    // Fibers stopped mid-kernel (after an error) are dropped with their
    // stacks' contents: the kernels hold no resources.
    free(fibers);
    free(l);
    return status;
}

// Calls a kernel whose parameters are all pointers with `args` cast to them.
template <class... P, size_t... I>
void call_with(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    kernel(static_cast<P>(args[I])...);
}

template <class... P>
int launch_kernel(void (*kernel)(P...), void** args, int nargs, unsigned int grid, unsigned int block,
                  int order) {
    if (nargs != (int)sizeof...(P)) {
        snprintf(last_error(), 256, "%d arguments for a kernel of %d parameters", nargs, (int)sizeof...(P));
        return -1;
    }
    struct Call {
        void (*kernel)(P...);
        void** args;
    } call{kernel, args};
    return launch(grid, block, order,
                  [](void* c) {
                      Call* k = static_cast<Call*>(c);
                      call_with(k->kernel, k->args, std::index_sequence_for<P...>{});
                  },
                  &call);
}

}  // namespace
}  // namespace widen_emu

// ---- The CUDA surface ----

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static

#define threadIdx (::widen_emu::thread_idx())
#define blockIdx (::widen_emu::block_idx())
#define blockDim (::widen_emu::block_dim())
#define gridDim (::widen_emu::grid_dim())
#define warpSize 32

inline void __syncthreads() {
    ::widen_emu::sync_block();
}

inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    ::widen_emu::sync_warp(mask);
}

template <class T>
inline T __shfl_sync(unsigned int mask, T v, int src, int width = 32) {
    return ::widen_emu::shuffle(mask, v, width, [src](int, int w) { return ((src % w) + w) % w; });
}

template <class T>
inline T __shfl_down_sync(unsigned int mask, T v, unsigned int delta, int width = 32) {
    return ::widen_emu::shuffle(mask, v, width, [delta](int lane, int) { return lane + (int)delta; });
}

template <class T>
inline T __shfl_up_sync(unsigned int mask, T v, unsigned int delta, int width = 32) {
    return ::widen_emu::shuffle(mask, v, width, [delta](int lane, int) { return lane - (int)delta; });
}

template <class T>
inline T __shfl_xor_sync(unsigned int mask, T v, int lane_mask, int width = 32) {
    return ::widen_emu::shuffle(mask, v, width, [lane_mask](int lane, int) { return lane ^ lane_mask; });
}

template <class To, class From>
inline To widen_emu_bit_cast(From v) {
    static_assert(sizeof(To) == sizeof(From), "bit casts keep the size");
    To out;
    memcpy(&out, &v, sizeof(To));
    return out;
}

inline float __int_as_float(int v) { return widen_emu_bit_cast<float>(v); }
inline int __float_as_int(float v) { return widen_emu_bit_cast<int>(v); }
inline float __uint_as_float(unsigned int v) { return widen_emu_bit_cast<float>(v); }
inline unsigned int __float_as_uint(float v) { return widen_emu_bit_cast<unsigned int>(v); }
inline double __longlong_as_double(long long v) { return widen_emu_bit_cast<double>(v); }
inline long long __double_as_longlong(double v) { return widen_emu_bit_cast<long long>(v); }

// The device library's fast intrinsics, as the host's accurate functions.
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
