// The four 1-D tensor-parallel schedules of CUTLASS's Distributed GEMM, as index math only.
//
// Used by the CPU executor, the CUDA executor and (mirrored) by jax_distgemm/_src/schedules.py;
// tests/schedules_test.py checks the Python mirror against ScheduleTable() below.
//
// Notation (row-major JAX arrays, batch dims L omitted):
//   out = x @ w,   x: [M, K],   w: [K, N],   TP devices d = 0..TP-1,   TP stages i = 0..TP-1.
//   "blk j" of a dimension is its j-th slice of size dim/TP.
//
// Assumptions, as in CUTLASS (dist_gemm_base_schedule.hpp):
//   - TP == number of stages; every device runs the same global problem.
//   - Exactly one operand rotates: x or w for AllGather, the partial output for ReduceScatter.
//   - Dimensions named below are divisible by TP (checked before launch).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DISTGEMM_HD __host__ __device__ __forceinline__
#else
#define DISTGEMM_HD inline
#endif

namespace jax_distgemm {

// Stable wire values: the `schedule` attribute of the FFI call.
enum class ScheduleKind : int32_t {
  kAllGather1D_TilingCD_RotatingA = 0,
  kAllGather1D_TilingCD_RotatingB = 1,
  kReduceScatter1D_TilingA_RotatingC = 2,
  kReduceScatter1D_TilingB_RotatingC = 3,
};
inline constexpr int kNumSchedules = 4;

DISTGEMM_HD int Mod(int a, int n) { return ((a % n) + n) % n; }

// AllGather1D_TilingCD_RotatingA: sequence-parallel all-gather + column-parallel linear.
//   device d holds x blk d of M (rows) and w blk d of N (cols); it produces out[:, blk d of N]
//   for all M rows.  At stage i it multiplies the x shard of device (d+i)%TP and writes
//   out rows blk (d+i)%TP.  Shards arrive by push: device s sends its x shard to device
//   (s-i)%TP, which consumes it at stage i.
//
//   TP=4, "xP" = x shard of device P, row = device, column = stage:
//            stage0  stage1  stage2  stage3
//     dev0    x0      x1      x2      x3
//     dev1    x1      x2      x3      x0
//     dev2    x2      x3      x0      x1
//     dev3    x3      x0      x1      x2
struct AllGather1D_TilingCD_RotatingA {
  static constexpr ScheduleKind kKind = ScheduleKind::kAllGather1D_TilingCD_RotatingA;
  // Whose shard device d consumes at stage i (== output row block written).
  static DISTGEMM_HD int Source(int d, int i, int tp) { return Mod(d + i, tp); }
  // Which output tile (row block of out) device d writes at stage i.
  static DISTGEMM_HD int OutputTile(int d, int i, int tp) { return Source(d, i, tp); }
  // Which device receives device s's shard for use at stage i (i >= 1).
  static DISTGEMM_HD int PushTarget(int s, int i, int tp) { return Mod(s - i, tp); }
};

// AllGather1D_TilingCD_RotatingB: all-gather of the weight (FSDP-style).
//   Same shards as RotatingA; device d produces out[blk d of M, :] for all N columns.
//   At stage i it multiplies the w shard of device (d+i)%TP and writes out column blk
//   (d+i)%TP.  The diagram is RotatingA's with wP in place of xP.
struct AllGather1D_TilingCD_RotatingB {
  static constexpr ScheduleKind kKind = ScheduleKind::kAllGather1D_TilingCD_RotatingB;
  static DISTGEMM_HD int Source(int d, int i, int tp) { return Mod(d + i, tp); }
  static DISTGEMM_HD int OutputTile(int d, int i, int tp) { return Source(d, i, tp); }
  static DISTGEMM_HD int PushTarget(int s, int i, int tp) { return Mod(s - i, tp); }
};

// ReduceScatter1D_TilingA_RotatingC: row-parallel linear + reduce-scatter over rows.
//   device d holds x blk d of K (cols) and w blk d of K (rows); it produces
//   out[blk d of M, :] = sum over devices of their partial products for that row block.
//   At stage i it computes the partial of row blk m = (d-1-i)%TP, adds the running sum
//   its left neighbour (d-1)%TP produced at stage i-1 for the same block, and hands the
//   result to its right neighbour (d+1)%TP.  The last stage (i = TP-1) lands on m = d.
//
//   TP=4, "Pm" = partial sum of row block m, row = device, column = stage:
//            stage0  stage1  stage2  stage3
//     dev0    P3      P2      P1      P0  <- out
//     dev1    P0      P3      P2      P1  <- out
//     dev2    P1      P0      P3      P2  <- out
//     dev3    P2      P1      P0      P3  <- out
//   dev d at stage i reads what dev (d-1) wrote at stage i-1 (same block: a true ring).
struct ReduceScatter1D_TilingA_RotatingC {
  static constexpr ScheduleKind kKind = ScheduleKind::kReduceScatter1D_TilingA_RotatingC;
  // Which row block of M (of x and of the partial) device d handles at stage i.
  static DISTGEMM_HD int OutputTile(int d, int i, int tp) { return Mod(d - 1 - i, tp); }
  // Who produced the running sum that device d adds at stage i (i >= 1).
  static DISTGEMM_HD int Source(int d, int i, int tp) { return Mod(d - 1, tp); }
  // Who consumes device d's running sum of stage i (i < TP-1).
  static DISTGEMM_HD int PushTarget(int d, int i, int tp) { return Mod(d + 1, tp); }
};

// ReduceScatter1D_TilingB_RotatingC: as TilingA, over column blocks of N:
//   device d produces out[:, blk d of N]; at stage i it computes the partial of column
//   block n = (d-1-i)%TP (w[:, blk n]).  The diagram is TilingA's.
struct ReduceScatter1D_TilingB_RotatingC {
  static constexpr ScheduleKind kKind = ScheduleKind::kReduceScatter1D_TilingB_RotatingC;
  static DISTGEMM_HD int OutputTile(int d, int i, int tp) { return Mod(d - 1 - i, tp); }
  static DISTGEMM_HD int Source(int d, int i, int tp) { return Mod(d - 1, tp); }
  static DISTGEMM_HD int PushTarget(int d, int i, int tp) { return Mod(d + 1, tp); }
};

// ReduceScatter1D_TilingA by gathering operands: a data path of TilingA (same inputs, same
// output), not a fifth schedule; asked for (rs_path gather), or the automatic path where it
// moves no more bytes than the ring (ChooseRsPath, cc/common/workspace.h); one batch and an
// unbatched w only.  No running sum travels: device d sums its own output rows (blk d of M)
// over every K shard, at stage i with shard s = (d+i)%TP, i.e. x_s's rows of blk d times w_s.
// Device s hands those to device (s-i)%TP, which consumes them at stage i: AllGather
// RotatingA's index math with (x rows, w) for the shard.
//
//   TP=4, "s" = x_s rows of blk d and w_s, row = device, column = stage:
//            stage0  stage1  stage2  stage3
//     dev0    0       1       2       3    -> out = rows blk 0
//     dev1    1       2       3       0    -> out = rows blk 1
//     dev2    2       3       0       1    -> out = rows blk 2
//     dev3    3       0       1       2    -> out = rows blk 3
struct ReduceScatter1D_TilingA_Gather {
  // Whose K shard device d multiplies at stage i.
  static DISTGEMM_HD int Source(int d, int i, int tp) { return Mod(d + i, tp); }
  // Which device consumes device s's (x rows, w) at stage i (i >= 1).
  static DISTGEMM_HD int PushTarget(int s, int i, int tp) { return Mod(s - i, tp); }
};

DISTGEMM_HD bool IsAllGather(ScheduleKind s) {
  return s == ScheduleKind::kAllGather1D_TilingCD_RotatingA ||
         s == ScheduleKind::kAllGather1D_TilingCD_RotatingB;
}

// Calls f(Schedule{}) with the schedule type named by `kind`.
template <class F>
auto VisitSchedule(ScheduleKind kind, F&& f) {
  switch (kind) {
    case ScheduleKind::kAllGather1D_TilingCD_RotatingA:
      return f(AllGather1D_TilingCD_RotatingA{});
    case ScheduleKind::kAllGather1D_TilingCD_RotatingB:
      return f(AllGather1D_TilingCD_RotatingB{});
    case ScheduleKind::kReduceScatter1D_TilingA_RotatingC:
      return f(ReduceScatter1D_TilingA_RotatingC{});
    case ScheduleKind::kReduceScatter1D_TilingB_RotatingC:
    default:
      return f(ReduceScatter1D_TilingB_RotatingC{});
  }
}

// One row of the schedule table: what device d does at stage i.
struct ScheduleEntry {
  int device, stage, output_tile, source, push_target;
};

// Fills `out` (tp*tp entries, device-major) for one schedule; used by tests.
inline void ScheduleTable(ScheduleKind kind, int tp, ScheduleEntry* out) {
  VisitSchedule(kind, [&](auto sched) {
    using S = decltype(sched);
    for (int d = 0; d < tp; ++d) {
      for (int i = 0; i < tp; ++i) {
        out[d * tp + i] = {d, i, S::OutputTile(d, i, tp), S::Source(d, i, tp),
                           S::PushTarget(d, i, tp)};
      }
    }
    return 0;
  });
}

}  // namespace jax_distgemm
