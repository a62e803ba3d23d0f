"""ComfyUI's attention masks as FlashAttention-4 ``mask_mod`` / ``score_mod`` callables (CuTe DSL), for the GPU mask
measurement in ``fa4.py`` only: the pack does not use them (it declines masked calls for ``flash_attn4``).

Both read the mask from ``aux_tensors[0]``, a 4-D ``[B, H, Nq, Nk]`` view (size-1 dims of ComfyUI's mask expanded with
stride 0, which FA4 keeps static in its compile key). ``keep_mask_mod``: an int32 0/1 tensor (a bool mask), scores
where it is 0 become -inf. ``bias_score_mod``: an fp32 additive mask added to the scaled scores, as SDPA adds
``attn_mask``. Imported only where flash-attn-4 imports (it needs cutlass).
"""

import cutlass
import cutlass.cute as cute
from flash_attn.cute import utils as fa_utils


@cute.jit
def keep_mask_mod(batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    keep = aux_tensors[0]
    val = fa_utils.scalar_to_ssa(keep[batch_idx[0], head_idx[0], q_idx[0], kv_idx[0]], cutlass.Int32)
    return val == fa_utils.scalar_to_ssa(1, cutlass.Int32)


@cute.jit
def bias_score_mod(score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    bias = aux_tensors[0]
    return score + fa_utils.scalar_to_ssa(bias[batch_idx[0], head_idx[0], q_idx[0], kv_idx[0]], cutlass.Float32)
