// The ReduceScatter data path of a call and the symmetric workspace it needs, in one place:
// the CUDA executor lays its slots out by these, the CPU executor follows the same path choice,
// and both nanobind modules expose them (rs_path, workspace_bytes) so that Python checks the
// workspace cap before launch without a model of its own.  Pure host code.
//
// The workspace of a device is two equal halves, one per call parity (epoch % 2), each holding
// the slots of one call, kSlotAlign-aligned:
//   AllGather            TP-1 slots of one shard of the rotating operand (input dtype), and
//                        for fp8 its scales from SlotScaleOffset on
//   ReduceScatter
//     kRemoteC           TP-1 slots of one running sum (output dtype), one per stage but the last
//     kCopyRing          2 (TP-1): send slots 0..TP-2, then receive slots TP-1..2 TP-3
//     kGather            TP-1 slots of [x rows of the block (sm x xk) | w (wk x wn) | fp8: their
//                        scales] (input dtype), one per source, then TP-1 local running sums
#pragma once

#include <cstddef>
#include <cstdint>

#include "cc/common/problem.h"

namespace jax_distgemm {

// The ReduceScatter data paths (cc/cuda/executor.h says what each does).  A call carries the
// path it asks for as its `rs_path` attribute, fixed when the call is lowered so that every
// device of the call agrees (jax_distgemm/_src/config.py, rs_path_override); kRsAuto: choose
// per shape.  The values are the attribute's (and Python's config.RS_PATHS).
enum RsPath : int { kRsAuto = 0, kRsRemoteC = 1, kRsCopyRing = 2, kRsGather = 3 };

// The name of `path` in Python's config.RS_PATHS ("" for kRsAuto or an unknown value).
const char* RsPathName(int path);

// The ReduceScatter path of `p` (a ReduceScatter problem), unless `requested` (an RsPath) forces
// one.  kGather (TilingA, TP > 1, one batch, an unbatched w: the x rows a peer needs and w are
// each one contiguous block) where asked for, or automatically where the operands a device
// needs from each peer are no more bytes than the running sum a ring stage moves
// (sk (sm + sn) <= sm sn): they travel from the call's start, a running sum only behind a
// stage.  Else kCopyRing where the running sum's transfer takes about as long as a stage's GEMM
// (stage k <= 2048), so that it must overlap the next one; else kRemoteC, which moves it in the
// consumer's epilogue.  A gather asked for where it does not apply gets the automatic choice.
RsPath ChooseRsPath(const Problem& p, int requested);

inline constexpr size_t kSlotAlign = 256;
inline size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

// Bytes of one slot: the rotating shard (AllGather; fp8: and its scales, from SlotScaleOffset)
// or one running sum (ReduceScatter).
size_t SlotBytes(const Problem& p);
size_t SlotScaleOffset(const Problem& p);
// kGather: one source's slot (x rows, then w at GatherWOffset; fp8: the rows' scales at
// GatherXScaleOffset, w's at GatherWScaleOffset), one running sum, one parity.
size_t GatherSlotBytes(const Problem& p);
size_t GatherWOffset(const Problem& p);
size_t GatherXScaleOffset(const Problem& p);
size_t GatherWScaleOffset(const Problem& p);
size_t GatherSumBytes(const Problem& p);
size_t GatherParityBytes(const Problem& p);

// Slots of SlotBytes per parity for `p` on `rs_path` (ChooseRsPath's path; kGather lays out
// its own, GatherParityBytes).
int SlotsPerParity(const Problem& p, RsPath rs_path);

// Symmetric workspace bytes one device needs for `p` with the path `requested` asks for (an
// RsPath): both parities.  0 at TP = 1.
size_t WorkspaceBytes(const Problem& p, int requested);

}  // namespace jax_distgemm
