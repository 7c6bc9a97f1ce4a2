// Sharing numbered tasks out over threads, for the compiled kernels (qscheme._cpu_gemv,
// qscheme._tile_gemm): run_tasks(count, tasks, job) calls job(task) once for every task in
// [0, tasks), on the caller and up to count - 1 other threads, each taking the next task from a
// shared counter, and returns when all are done.
//
// Built with OpenMP (the normal build: setup.py passes -fopenmp where the compiler has it), the
// threads are OpenMP's. The extension then needs "libgomp.so.1", which the dynamic loader finds
// already loaded by torch (torch/lib/libgomp.so.1, the same soname; qscheme imports torch first),
// so the kernels run on torch's own intra-op threads. A pool of their own was measured to lose
// about a third of each call beside torch's operators: torch's OpenMP threads keep spinning on the
// cores after each operator, and a second pool's workers waited for those cores.
//
// Without OpenMP, a pool of this file's own threads: the caller never waits for a worker that has
// not started (it may wait long for a core on a busy machine); once every task is taken it closes
// the run and waits only for the workers inside it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#ifdef _OPENMP
#include <omp.h>
#else
#include <condition_variable>
#include <mutex>
#include <thread>
#endif

namespace qscheme_threads {

#ifndef _OPENMP
class Pool {
   public:
    void run(int count, int64_t tasks, const std::function<void(int64_t)> &job) {
        std::lock_guard<std::mutex> serial(serial_);
        next_.store(0);
        tasks_ = tasks;
        if (count > 1) {
            while (threads_ < count - 1) {
                const int index = threads_++;
                std::thread([this, index] { loop(index); }).detach();  // lives as long as the process
            }
            {
                std::lock_guard<std::mutex> lock(mutex_);
                job_ = &job;
                wanted_ = count - 1;
                open_ = true;
                generation_++;
            }
            wake_.notify_all();
        }
        take(job);
        if (count > 1) {
            std::unique_lock<std::mutex> lock(mutex_);
            open_ = false;
            done_.wait(lock, [this] { return active_ == 0; });
            job_ = nullptr;
        }
    }

   private:
    void take(const std::function<void(int64_t)> &job) {
        for (int64_t task = next_.fetch_add(1); task < tasks_; task = next_.fetch_add(1)) job(task);
    }
    void loop(int index) {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int64_t)> *job;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return generation_ != seen; });
                seen = generation_;
                if (index >= wanted_ || !open_) continue;  // a run already closed: nothing left
                job = job_;
                active_++;
            }
            take(*job);
            std::lock_guard<std::mutex> lock(mutex_);
            if (--active_ == 0) done_.notify_one();
        }
    }
    std::mutex serial_, mutex_;
    std::condition_variable wake_, done_;
    int threads_ = 0, wanted_ = 0, active_ = 0;
    const std::function<void(int64_t)> *job_ = nullptr;
    std::atomic<int64_t> next_{0};
    int64_t tasks_ = 0;
    bool open_ = false;
    uint64_t generation_ = 0;
};

inline Pool *pool() {
    static Pool *instance = new Pool();  // never destroyed: detached workers wait on it
    return instance;
}
#endif

inline void run_tasks(int count, int64_t tasks, const std::function<void(int64_t)> &job) {
    if (count <= 1 || tasks <= 1) {
        for (int64_t task = 0; task < tasks; task++) job(task);
        return;
    }
#ifdef _OPENMP
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(count)
    {
        for (int64_t task = next.fetch_add(1); task < tasks; task = next.fetch_add(1)) job(task);
    }
#else
    pool()->run(count, tasks, job);
#endif
}

// The rows of each worker's one span of n rows split over `threads` workers: an even share rounded
// up to a multiple of 4 (the loops' row blocks), at least `least`. The GEMV loops prefetch along
// each row and past its end into the next rows, so a span read in order keeps the memory busy from
// its start, where small pieces shared out in turn each start cold.
inline int64_t span_rows(int64_t n, int threads, int64_t least) {
    const int64_t share = ((n + threads - 1) / threads + 3) / 4 * 4;
    return share > least ? share : least;
}

// Whether the kernels run on OpenMP's threads (torch's, see above) or on their own pool.
inline bool openmp() {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
}

}  // namespace qscheme_threads
