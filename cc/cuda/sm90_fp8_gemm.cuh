// CUTLASS 3.x SM90 fp8 stage GEMMs (device code), wrapped by StageKernel like the bf16 ones.
//
// Per-tensor scaling: CUTLASS's fp8 collective (sm90_mma_tma_gmma_ss_warpspecialized_fp8.hpp)
// with our consumer loop (sm90_fp8_staggered_mainloop.cuh), whose two warpgroups run half a K
// tile apart, so that one adds its partial sums into the fp32 totals while the other's wgmmas
// run, or for launches with few tiles the split loop below without scales; the scales
// sa * sb (device scalars) and alpha fold into the epilogue.
// Block scaling: CUTLASS's blockwise collective
// (sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp), at 128x256 with our
// consumer loop (sm90_fp8_split_mainloop.cuh), at 128x128 with CUTLASS's: per 128-wide K tile,
// the partial sums are multiplied by sfa (per row) * sfb (per 128-column block) and added into
// the fp32 accumulators; the epilogue is the plain alpha * acc + beta * C.
//
// Layouts are fp8_gemm.h's: A [M, K] and B^T [N, K] K-major (CUTLASS: A RowMajor, B
// ColumnMajor), C, D [M, N] row-major.
//
// Include only from the sm90_fp8_gemm_*.cu instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cc/cuda/fp8_gemm.h"
#include "cc/cuda/sm90_fp8_split_mainloop.cuh"
#include "cc/cuda/sm90_fp8_staggered_mainloop.cuh"
#include "cc/cuda/sm90_gemm.cuh"  // StageKernel, PrepareKernel
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/float8.h"

namespace jax_distgemm::cuda {

using namespace cute;

// -- Types ----------------------------------------------------------------------------------------

template <Fp8Type kType>
struct Fp8Element;
template <>
struct Fp8Element<Fp8Type::kE4M3> {
  using type = cutlass::float_e4m3_t;
};
template <>
struct Fp8Element<Fp8Type::kE5M2> {
  using type = cutlass::float_e5m2_t;
};

template <ElemType kType>
struct OutElement;
template <>
struct OutElement<ElemType::kBF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct OutElement<ElemType::kF32> {
  using type = float;
};

// -- Config ---------------------------------------------------------------------------------------
//
// Why these tiles.  The fp32 promotion keeps the tensor cores' partial sums apart from the fp32
// totals, so a consumer warpgroup's 64 x N share of the CTA tile costs N/2 registers per thread
// per accumulator set; a consumer thread gets 232 (setmaxnreg).  Wider tiles read less shared
// memory and L2 per flop.  Per tensor, the staggered loop holds two whole-width sets and keeps the
// tensor cores busy through its adds by running the warpgroups half a K tile apart: 128x192 in 192
// registers.  Per block, the split loop reaches the bf16 kernels' 128x256 with one half-width
// partial set (192) and leaves its adds to the other warpgroup's wgmmas; the stagger would mix two
// K tiles' block scales in one group.  Per tensor the split loop, with one half's groups
// staggered, runs where 128x192 tiles leave much of a last wave idle (Fp8PickConfig); elsewhere it
// is slower.  M stays 128: two warpgroups of 64 rows.  K tile 128: one block-scale block per K
// tile.  Clusters of 2 multicast one operand's tile to both CTAs (halving its L2 reads); 2x1
// shares B (the weight), 1x2 shares A; 2x2 ran slower, as fewer 4-CTA clusters fit on the SMs (116
// CTAs on a 132-SM H100).  Not taken, per tensor, all slower than the staggered loop at 128x192 at
// most stage shapes: three sets at 128x128 (two partial sets in turn, each added under the next K
// tile's wgmmas; at 128x144 they spill); CUTLASS's loop (both warpgroups add at once) at 128x128
// to 128x192; the warpgroups taking turns at the tensor cores behind a barrier, which serializes
// their issue; A in registers (loaded once per warpgroup and K tile, the wgmmas in two column
// halves with a partial set each), slower at 128x128 and spilling at 128x192; the staggered loop
// at 128x128 (also at the stage shape with the fewest tiles).  Not taken for the
// split loop: holding warpgroup 1 one half back with a named barrier per tile, no consistent gain
// (per tensor, groups that straddle two K tiles keep the offset without one).
// NOTE: the block-scaled kernels spill a few bytes, at the tile loop's head and tail (the
// scheduler's work tile), not in the K loop.
template <Fp8Config kConfig>
struct Fp8ConfigTraits;

// Whose consumer loop promotes the tensor cores' partial sums into the fp32 totals.
enum class Fp8Promotion {
  kCutlass,     // CUTLASS's collective
  kStaggered,   // per tensor: the warpgroups half a K tile apart, two sets
  kSplit,       // 128x256: each warpgroup's share in two halves, one partial set
};

// kBand: the tile order's band of clusters along M (Fp8GemmLaunch::max_swizzle's default).
template <int kM, int kN, int kCm, int kCn, Fp8Promotion kLoop = Fp8Promotion::kCutlass,
          int kBand = 8>
struct Fp8Cooperative {
  static constexpr Fp8Promotion kPromotion = kLoop;
  static constexpr int kSwizzle = kBand;
  using TileShape = Shape<Int<kM>, Int<kN>, _128>;
  using ClusterShape = Shape<Int<kCm>, Int<kCn>, _1>;
  using TensorSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using BlockSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

template <>
struct Fp8ConfigTraits<Fp8Config::kCoop128x128_C1x2> : Fp8Cooperative<128, 128, 1, 2> {};
template <>
struct Fp8ConfigTraits<Fp8Config::kStagger128x192_C2x1>
    : Fp8Cooperative<128, 192, 2, 1, Fp8Promotion::kStaggered, 4> {};
template <>
struct Fp8ConfigTraits<Fp8Config::kSplit128x256_C2x1>
    : Fp8Cooperative<128, 256, 2, 1, Fp8Promotion::kSplit> {};

// -- Epilogues ------------------------------------------------------------------------------------

// Per-tensor: D = (alpha * sa * sb) * acc + beta * C.  The three-way scalar broadcast is
// CUTLASS's own fp8 pattern (Sm90ScaledLinCombPerRowBias: "scale_a * scale_b * alpha"); each
// thread reads sa and sb once per kernel, after StageSync's wait.  Beta as a scalar broadcast
// keeps CUTLASS's beta == 0 test, which skips the C loads.
template <class ElementD, class ElementC>
using Fp8TensorScaledLinComb = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, int64_t>>,  // beta
    cutlass::epilogue::fusion::Sm90SrcFetch<ElementC>,                                // C
    cutlass::epilogue::fusion::Sm90EVT<
        cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                               cutlass::FloatRoundStyle::round_to_nearest>,
        cutlass::epilogue::fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, int64_t>, 3>,
        cutlass::epilogue::fusion::Sm90AccFetch>>;

// -- Kernels --------------------------------------------------------------------------------------

// Block scales: K-major both (the layout CUTLASS's unit test
// sm90_gemm_f8_f8_f8_tensor_op_f32_blockwise.cu runs as "k_maj_k_maj"), granularity 1 x 128 for
// A (per row), 128 x 128 for B.  With a 128-row tile A's 128 scales per K tile would go by TMA
// only when M-major; K-major, the mainloop's auxiliary producer warp loads them with cp.async
// (4 per lane per K tile), off the critical path.
using Fp8BlockScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K,
                                              cute::GMMA::Major::K>;
using Fp8LayoutSFA = decltype(Fp8BlockScaleConfig::deduce_layoutSFA());
using Fp8LayoutSFB = decltype(Fp8BlockScaleConfig::deduce_layoutSFB());

template <Fp8Scaling kScaling, Fp8Config kConfig, class ElementA, class ElementB, class ElementD,
          bool kHasC>
struct Sm90Fp8Gemm {
  using Traits = Fp8ConfigTraits<kConfig>;
  using ElementC = cute::conditional_t<kHasC, ElementD, void>;
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;     // [M, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // B [K, N] column-major = B^T [N, K] row-major
  using LayoutC = cutlass::layout::RowMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  static constexpr int kAlignC = kAlignD;
  static constexpr bool kBlock = kScaling == Fp8Scaling::kBlock;

  static_assert(!kBlock || size<1>(typename Traits::TileShape{}) % 128 == 0,
                "block scaling: the N tile must hold whole 128-column scale blocks");
  static_assert(size<0>(typename Traits::TileShape{}) == 128 &&
                    size<1>(typename Traits::TileShape{}) == Fp8ConfigTileN(kConfig),
                "Fp8PickConfig counts tiles of 128 x Fp8ConfigTileN");
  static_assert(kBlock || (size<0>(typename Traits::ClusterShape{}) == 2 &&
                           size<1>(typename Traits::ClusterShape{}) == 1),
                "Fp8PickConfig counts per-tensor tiles in 2x1 clusters");

  using Fusion = cute::conditional_t<
      kBlock,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>,
      Fp8TensorScaledLinComb<ElementD, ElementC>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Traits::TileShape,
      typename Traits::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc,
      float, ElementC, LayoutC, kAlignC, ElementD, LayoutD, kAlignD,
      typename Traits::EpilogueSchedule, Fusion>::CollectiveOp;

  using GmemLayoutA =
      cute::conditional_t<kBlock, cute::tuple<LayoutA, Fp8LayoutSFA>, LayoutA>;
  using GmemLayoutB =
      cute::conditional_t<kBlock, cute::tuple<LayoutB, Fp8LayoutSFB>, LayoutB>;
  using MainloopSchedule = cute::conditional_t<kBlock, typename Traits::BlockSchedule,
                                               typename Traits::TensorSchedule>;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, GmemLayoutA, kAlignAB,
      ElementB, GmemLayoutB, kAlignAB, ElementAcc, typename Traits::TileShape,
      typename Traits::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  static_assert(!(kBlock && Traits::kPromotion == Fp8Promotion::kStaggered),
                "the staggered promotion is per-tensor only (sm90_fp8_staggered_mainloop.cuh)");
  using CollectiveMainloop = cute::conditional_t<
      Traits::kPromotion == Fp8Promotion::kStaggered, Fp8StaggeredPromotion<BuiltMainloop>,
      cute::conditional_t<Traits::kPromotion == Fp8Promotion::kSplit,
                          Fp8SplitPromotion<BuiltMainloop, kBlock>, BuiltMainloop>>;

  // NOTE: CUTLASS's builder takes the widest wgmma whose n divides the tile's N among the
  // shapes it is built with (256, 192, 128, 96, 64, 32, 16, 8 without
  // CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED), so another N compiles and runs correct, several
  // narrow wgmmas per K block at a fraction of the rate.  The split loop and the blockwise
  // collective issue one 128-column half or scale block per wgmma.
  static_assert(size<1>(typename CollectiveMainloop::TiledMma::AtomShape_MNK{}) ==
                    (kBlock || Traits::kPromotion == Fp8Promotion::kSplit
                         ? 128
                         : size<1>(typename Traits::TileShape{})),
                "a wgmma must span the CTA tile's N (the split loop's half, a scale block)");

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                          CollectiveMainloop, CollectiveEpilogue>;
};

// -- Host launch ----------------------------------------------------------------------------------

template <Fp8Scaling kScaling, Fp8Config kConfig, Fp8Type kA, Fp8Type kB, ElemType kD, bool kHasC>
struct StageFp8Gemm {
  using ElementA = typename Fp8Element<kA>::type;
  using ElementB = typename Fp8Element<kB>::type;
  using ElementD = typename OutElement<kD>::type;
  using Gemm = Sm90Fp8Gemm<kScaling, kConfig, ElementA, ElementB, ElementD, kHasC>;
  using BaseKernel = typename Gemm::GemmKernel;
  using Kernel = StageKernel<BaseKernel>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename BaseKernel::Arguments;

  static Arguments MakeArguments(const Fp8GemmLaunch& g) {
    using StrideA = typename BaseKernel::StrideA;
    using StrideB = typename BaseKernel::StrideB;
    using StrideC = typename BaseKernel::StrideC;
    using StrideD = typename BaseKernel::StrideD;
    const Fp8GemmOperands& o = g.ops;
    // Without C, a has_c kernel gets D as its source (a valid TMA descriptor) and beta 0, so
    // it never loads it (fp8_gemm.h, Fp8GemmEntry).
    const bool use_c = kHasC && o.c != nullptr;
    const void* c = use_c ? o.c : o.d;
    const int64_t ldc = use_c ? o.ldc : o.ldd;
    const int64_t batch_stride_c = use_c ? o.batch_stride_c : o.batch_stride_d;
    const float beta = use_c ? o.beta : 0.f;

    Arguments args{};
    args.mode = o.batch > 1 ? cutlass::gemm::GemmUniversalMode::kBatched
                            : cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {static_cast<int>(o.m), static_cast<int>(o.n), static_cast<int>(o.k),
                          static_cast<int>(o.batch)};
    StrideA stride_a = make_stride(o.lda, Int<1>{}, o.batch_stride_a);
    StrideB stride_b = make_stride(o.ldb, Int<1>{}, o.batch_stride_b);  // (n, k, l)
    if constexpr (Gemm::kBlock) {
      const int kb = static_cast<int>((o.k + 127) / 128);
      const int nb = static_cast<int>((o.n + 127) / 128);
      // ((row granularity, rows), (K granularity, K blocks), batch): zero strides inside a
      // scale block, ld between rows (A) or 128-column blocks (B), 1 between K blocks.
      Fp8LayoutSFA layout_sfa = make_layout(
          make_shape(make_shape(_1{}, static_cast<int>(o.m)), make_shape(_128{}, kb),
                     static_cast<int>(o.batch)),
          make_stride(make_stride(_0{}, static_cast<int>(o.ld_sfa)), make_stride(_0{}, _1{}),
                      static_cast<int>(o.batch_stride_sfa)));
      Fp8LayoutSFB layout_sfb = make_layout(
          make_shape(make_shape(_128{}, nb), make_shape(_128{}, kb), static_cast<int>(o.batch)),
          make_stride(make_stride(_0{}, static_cast<int>(o.ld_sfb)), make_stride(_0{}, _1{}),
                      static_cast<int>(o.batch_stride_sfb)));
      args.mainloop = {static_cast<const ElementA*>(o.a), stride_a,
                       static_cast<const ElementB*>(o.b), stride_b,
                       o.sfa, layout_sfa, o.sfb, layout_sfb};
      args.epilogue.thread.alpha = o.alpha;
      args.epilogue.thread.beta = beta;
    } else {
      // The staggered mainloop promotes every 128 of K; the base's interval field goes unused.
      args.mainloop = {static_cast<const ElementA*>(o.a), stride_a,
                       static_cast<const ElementB*>(o.b), stride_b};
      // Fp8TensorScaledLinComb's arguments, in its tree order: beta, C, (alpha sa sb, acc, *), +.
      args.epilogue.thread = {
          {{beta}, {nullptr}, {}},
          {},
          {{{o.alpha, 1.f, 1.f}, {nullptr, o.scale_a, o.scale_b}, {}}, {}, {}},
          {}};
    }
    if constexpr (kHasC) {
      args.epilogue.ptr_C = static_cast<const ElementD*>(c);
    }
    args.epilogue.dC = StrideC(make_stride(ldc, Int<1>{}, batch_stride_c));
    args.epilogue.ptr_D = static_cast<ElementD*>(o.d);
    args.epilogue.dD = StrideD(make_stride(o.ldd, Int<1>{}, o.batch_stride_d));
    args.hw_info.device_id = g.device;
    args.hw_info.sm_count = g.sm_count;
    args.scheduler.max_swizzle_size =
        g.max_swizzle > 0 ? g.max_swizzle : Gemm::Traits::kSwizzle;
    using RasterOrderOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = g.raster == 1   ? RasterOrderOptions::AlongM
                                  : g.raster == 2 ? RasterOrderOptions::AlongN
                                                  : RasterOrderOptions::Heuristic;
    return args;
  }

  static size_t WorkspaceBytes(const Fp8GemmLaunch& g) {
    return BaseKernel::get_workspace_size(MakeArguments(g));
  }

  static std::string Launch(const Fp8GemmLaunch& g, cudaStream_t stream) {
    Arguments args = MakeArguments(g);
    if (!BaseKernel::can_implement(args)) {
      return std::string("CUTLASS cannot implement this fp8 stage GEMM (") +
             Fp8ConfigName(kConfig) + "): check 16-byte alignment of every row pitch";
    }
    typename Kernel::Params params{BaseKernel::to_underlying_arguments(args, g.workspace),
                                   g.sync};
    DropBandPadding<BaseKernel>(params.base, g.ops.m, g.ops.n);
    cutlass::Status st = Adapter::run(params, stream, nullptr, g.pdl);
    if (st != cutlass::Status::kSuccess) {
      return std::string("CUTLASS launch failed: ") + cutlass::cutlassGetStatusString(st) +
             " / " + cudaGetErrorString(cudaGetLastError());
    }
    return "";
  }

  static std::string Prepare() { return PrepareKernel<Kernel>(); }
};

}  // namespace jax_distgemm::cuda

// The registry entry of one compiled kernel.
#define DISTGEMM_FP8_ENTRY(SCALING, CONFIG, A, B, D, HAS_C)                                 \
  ::jax_distgemm::cuda::Fp8GemmEntry {                                                          \
    SCALING, CONFIG, A, B, D, HAS_C,                                                            \
        &::jax_distgemm::cuda::StageFp8Gemm<SCALING, CONFIG, A, B, D, HAS_C>::Launch,           \
        &::jax_distgemm::cuda::StageFp8Gemm<SCALING, CONFIG, A, B, D, HAS_C>::WorkspaceBytes,   \
        &::jax_distgemm::cuda::StageFp8Gemm<SCALING, CONFIG, A, B, D, HAS_C>::Prepare           \
  }
