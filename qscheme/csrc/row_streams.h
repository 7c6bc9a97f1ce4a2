// How a GEMV worker walks its span of weight rows, R rows at a time (R accumulators side by side).
//
// streams<R>(n0, n1, body): rows [n0, n1) as R streams of consecutive rows, one per R-th of the
// span; each pass takes the next row of every stream (body(R, n, step): rows n, n + step, ...,
// n + (R - 1) step), and the rows left over one at a time (body(1, n, 1)). Each stream then reads
// memory in order, as the hardware prefetchers expect; a loop's software prefetches run ahead along
// each stream (past a row's end, into its stream's next row). R neighbouring rows at a time (n, n + 1,
// ...) read R short runs of one region by turns instead, which the prefetchers follow badly. On the
// 2-core Zen 4, from memory (a Llama-shaped stack of layers, 2 threads, same runs), the neighbouring
// rows' times against the streams': GGUF Q4_0 1.23-1.30x, Q6_K 1.26x, Q8_0 1.63x, NVFP4A16 1.12x,
// int4 g128 1.31x, FP8 2.1x; plain loads with little work between them moved 20 against 33 GB/s.
#pragma once

#include <cstdint>
#include <type_traits>

namespace qscheme_rows {

template <int R, typename Body>
inline void streams(int64_t n0, int64_t n1, Body &&body) {
    const int64_t step = (n1 - n0) / R;
    for (int64_t i = 0; i < step; i++) body(std::integral_constant<int, R>(), n0 + i, step);
    for (int64_t n = n0 + R * step; n < n1; n++) body(std::integral_constant<int, 1>(), n, int64_t{1});
}

// Rows from a row of a pass (body(R, n, step)) to the next one its stream reads, where a software
// prefetch past the row's end aims: the next row, or with streams of one row each (step 1) the row
// after the pass's R.
template <int R>
inline constexpr int64_t stream_next(int64_t step) {
    return step == 1 ? R : 1;
}

}  // namespace qscheme_rows
