#include "cc/common/workspace.h"

namespace jax_distgemm {
namespace {

struct RsPathEntry {
  RsPath path;
  const char* name;
};
constexpr RsPathEntry kRsPathNames[] = {
    {kRsRemoteC, "remote_c"}, {kRsCopyRing, "copy_ring"}, {kRsGather, "gather"}};

bool RsGatherApplies(const Problem& p) {
  return p.schedule == ScheduleKind::kReduceScatter1D_TilingA_RotatingC && p.tp > 1 &&
         p.batch == 1 && !p.w_batched;
}

bool RsGatherMovesNoMore(const Problem& p) {
  return p.sk() * (p.sm() + p.sn()) <= p.sm() * p.sn();
}

}  // namespace

const char* RsPathName(int path) {
  for (const RsPathEntry& e : kRsPathNames) {
    if (e.path == path) return e.name;
  }
  return "";
}

RsPath ChooseRsPath(const Problem& p, int requested) {
  if (RsGatherApplies(p) &&
      (requested == kRsGather || (requested == kRsAuto && RsGatherMovesNoMore(p)))) {
    return kRsGather;
  }
  if (requested == kRsAuto || requested == kRsGather) {
    return p.sk() <= 2048 ? kRsCopyRing : kRsRemoteC;
  }
  return static_cast<RsPath>(requested);
}

namespace {
// fp32 scales of `elems` values' worth: 0 without scaling.
size_t ScaleBytes(const Problem& p, int64_t scale_elems) {
  return p.scaling == Scaling::kNone ? 0
                                     : RoundUp(scale_elems * sizeof(float), kSlotAlign);
}
}  // namespace

size_t SlotScaleOffset(const Problem& p) {
  const bool rot_a = p.schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA;
  return RoundUp((rot_a ? p.XElems() : p.WElems()) * ElemSize(p.in_type), kSlotAlign);
}

size_t SlotBytes(const Problem& p) {
  if (IsAllGather(p.schedule)) {
    const bool rot_a = p.schedule == ScheduleKind::kAllGather1D_TilingCD_RotatingA;
    return SlotScaleOffset(p) + ScaleBytes(p, rot_a ? p.XScaleElems() : p.WScaleElems());
  }
  return RoundUp(p.PartialElems() * ElemSize(p.out_type), kSlotAlign);
}

size_t GatherWOffset(const Problem& p) {
  return RoundUp(p.sm() * p.xk * ElemSize(p.in_type), kSlotAlign);
}
size_t GatherXScaleOffset(const Problem& p) {
  return GatherWOffset(p) + RoundUp(p.WElems() * ElemSize(p.w_type), kSlotAlign);
}
size_t GatherWScaleOffset(const Problem& p) {
  const int64_t rows = p.scaling == Scaling::kBlock ? p.sm() * (p.xk / kScaleBlock) : 1;
  return GatherXScaleOffset(p) + ScaleBytes(p, rows);
}
size_t GatherSlotBytes(const Problem& p) {
  return GatherWScaleOffset(p) + ScaleBytes(p, p.WScaleElems());
}
size_t GatherSumBytes(const Problem& p) {
  return RoundUp(p.PartialElems() * ElemSize(p.out_type), kSlotAlign);
}
size_t GatherParityBytes(const Problem& p) {
  return (p.tp - 1) * (GatherSlotBytes(p) + GatherSumBytes(p));
}

int SlotsPerParity(const Problem& p, RsPath rs_path) {
  if (IsAllGather(p.schedule)) return p.tp - 1;
  return rs_path == kRsCopyRing ? 2 * (p.tp - 1) : p.tp - 1;
}

size_t WorkspaceBytes(const Problem& p, int requested) {
  if (p.tp <= 1) return 0;
  if (IsAllGather(p.schedule)) return 2 * static_cast<size_t>(SlotsPerParity(p, kRsAuto)) *
                                      SlotBytes(p);
  const RsPath path = ChooseRsPath(p, requested);
  if (path == kRsGather) return 2 * GatherParityBytes(p);
  return 2 * static_cast<size_t>(SlotsPerParity(p, path)) * SlotBytes(p);
}

}  // namespace jax_distgemm
