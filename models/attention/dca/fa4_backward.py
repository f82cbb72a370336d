"""Dual Chunk Attention's backward as one kernel: FlashAttention-4's SM90 backward, the query
part chosen per block.

A key block n meets every query block m at or after it, each pair in exactly one part (the
chunk distance: 0 intra, 1 successive, >= 2 inter), so DCA's backward has causal attention's
loop. This kernel is FA4's SM90 causal backward (`FlashAttentionBackwardSm90`, unchanged
consumer warps) with two producers changed: the Q load reads the query block from its part's
rotated copy (q_rot [parts * b, s, hq, d], the part the batch coordinate), and the dQ store adds
into that part's float32 accumulator. LSE, dO and dPsum are the merged ones, alike for all parts.
So dK and dV leave the kernel once, summed over the parts in registers, and the preprocess runs
over the rows once; the part calls' per-call launches and the one-call path's per-part dK/dV
and pre-processing are gone. What stays outside: the rotations (q into its parts, k, and dk
back) and the parts' dQ accumulators, rotated back and summed into dq in one pass
(dq_parts.py, in place of FA4's postprocess). A query block past its chunk's first
`successive_rows` rows adds its successive tiles' dQ into the inter accumulator, as it reads
their Q from the inter copy (the same rotation there, DCAPlan.successive_rows).

The queries may be the last rows of the keys' (FA4's bottom-right causal alignment): then the
kernel gives those queries' complete dq and their share of dk and dv, so a backward may run in
pieces of query rows (grouped.backward, on short sequences or where groups of heads do not
bound its memory enough): a later piece's kernel adds its dK/dV to the earlier pieces' in place
(TMA reduce-add stores, `_reduce_add_call`), or with GQA every piece's into one pair of float32 sums
(`kv_accumulators`, `store_kv`). A group of heads is one such backward on views of its heads.

Needs the chunk length L and the query and key rows to be multiples of 128 (every tile then
lies in one chunk, and only intra's diagonal tiles are partly masked, by the causal mask). FA4
(and its CuTe DSL) is imported on first use; `backward` is called only where
kernels.fa4_applies.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch

from models.attention.dca import fa4_parts
from models.attention.dca.dq_parts import DQParts
from models.attention.dca.plan import KERNEL_BLOCK, KERNEL_HEAD_DIMS


def backward(q_rot: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             dout: torch.Tensor, lse: torch.Tensor, scale: float, length: int,
             successive_rows: int, dk: torch.Tensor, dv: torch.Tensor,
             accumulate: bool) -> DQParts:
    """The per-part dQ of the rotated queries (float32 accumulators, DQParts), for queries
    that are the last s_q of the s_k key rows (s_q = s_k: all of them); their dK (of k_rot) and
    dV into dk and dv.

    q_rot: [p * b, s_q, hq, d] part-major (the successive copy read only in each chunk's first
    `successive_rows` rows, DCAPlan.successive_rows; its dQ accumulator holds, and is zeroed,
    only there); k_rot, v: [b, s_k, hk, d]; out, dout: merged [b, s_q, hq, d]; lse: merged [b,
    hq, s_q] float32; length: the chunk length L. L, successive_rows, s_q and s_k must be
    multiples of 128. With s_q < s_k, dq is complete (the queries' keys all lie in the first s_k
    rows) and dK, dV are these queries' share. Without GQA dk and dv are [b, s_k, hk, d] (views
    with a unit last stride) that the kernel stores into, or adds to (`accumulate`: a bf16 TMA
    reduce-add, one rounding per call). With GQA (several query heads add into one key head)
    they are float32 sums from `kv_accumulators`, for at least s_k key rows, that the kernel
    adds to whatever `accumulate` says; `store_kv` converts them once, after the last call.
    """
    from flash_attn.cute import interface as fa  # with FA4 only

    batch, seq, heads, head_dim = out.shape
    seq_k, heads_kv, head_dim_v = v.shape[1], v.shape[2], v.shape[3]
    parts = q_rot.shape[0] // batch
    if (length % KERNEL_BLOCK or successive_rows % KERNEL_BLOCK or seq % KERNEL_BLOCK
            or seq_k % KERNEL_BLOCK or seq > seq_k):
        raise ValueError(f"the DCA backward kernel needs L ({length}), the successive rows "
                         f"({successive_rows}) and the query ({seq}) and key ({seq_k}) rows to "
                         f"be multiples of {KERNEL_BLOCK}, queries <= keys")
    cfg, multiple = _accumulator_layout(head_dim, head_dim_v)
    tile_m = cfg.m_block_size
    if (cfg.dQ_swapAB or tile_m // cfg.AtomLayoutMdQ != 64
            or head_dim not in KERNEL_HEAD_DIMS):
        raise ValueError(f"head_dim {head_dim}: FA4's dQ accumulator is not in the layout "
                         "dq_parts.fa4_sm90_rows reads")
    gqa = heads_kv < heads
    if gqa != (dk.dtype == torch.float32):
        raise ValueError("dk and dv must be kv_accumulators' float32 sums with GQA, and the "
                         f"gradients themselves without it (got {dk.dtype} for {heads} query "
                         f"and {heads_kv} key heads)")
    dtype = fa.torch2cute_dtype_map[q_rot.dtype]
    dim_acc = -(-head_dim // multiple) * multiple
    device = out.device
    q_rot, k_rot, v, out, dout, lse = (fa.maybe_contiguous(t)
                                       for t in (q_rot, k_rot, v, out, dout, lse))

    # zeroed before the preprocess: the main kernel (launched with PDL) may start while the
    # kernel before it runs, and waits for it only before reading LSE and dPsum
    dq_accum = _zeroed_accumulators(parts, batch, heads, seq, seq_k, dim_acc, length,
                                    successive_rows, device)
    dpsum = torch.empty(batch, heads, seq, dtype=torch.float32, device=device)
    lse_log2 = torch.empty_like(dpsum)
    fa._bwd_preprocess(out, dout, dpsum, lse, lse_log2, None, None, None, None, dtype,
                       head_dim, head_dim_v, tile_m, fake_mode=False, hdim_multiple_of=multiple)
    kernel = _compiled(dtype, head_dim, head_dim_v, heads // heads_kv, length, parts,
                       successive_rows, accumulate and not gqa,
                       (q_rot, k_rot, v, dout, lse_log2, dpsum, dq_accum, dk, dv), scale)
    kernel(q_rot.detach(), k_rot.detach(), v.detach(), dout, lse_log2, dpsum, dq_accum, dk, dv,
           scale, None, None, None, None, None, None, None, None, None, fa.AuxData(None, None),
           None, None)
    return DQParts(dq_accum, "fa4_sm90")


def _zeroed_accumulators(parts: int, batch: int, heads: int, seq: int, seq_k: int,
                         dim_acc: int, length: int, successive_rows: int,
                         device: torch.device) -> torch.Tensor:
    """The parts' float32 dQ accumulators [p * b, h, s_q * d'] for queries that are the last
    s_q of s_k rows, zeroed where the kernel adds: everywhere but the successive part's rows
    past each chunk's first `successive_rows` (whose tiles go to the inter accumulator)."""
    if parts < 3 or successive_rows == length:
        return torch.zeros(parts * batch, heads, seq * dim_acc, dtype=torch.float32,
                           device=device)
    accum = torch.empty(parts, batch, heads, seq * dim_acc, dtype=torch.float32, device=device)
    accum[0].zero_()  # intra and inter, each contiguous (a strided fill of both is slower)
    accum[2].zero_()
    groups = accum[1].view(batch, heads, seq // 64, 64 * dim_acc)  # 64 rows apiece
    groups.index_fill_(2, _successive_groups(seq, seq_k, length, successive_rows, device), 0)
    return accum.view(parts * batch, heads, seq * dim_acc)


@functools.lru_cache(maxsize=32)
def _successive_groups(seq: int, seq_k: int, length: int, successive_rows: int,
                       device: torch.device) -> torch.Tensor:
    """The 64-row groups of the last s_q of s_k rows that lie in a chunk's first
    successive_rows rows (their row offsets in the accumulator layout: multiples of 64 rows)."""
    first = seq_k - seq  # the queries' first row among the keys'
    rows = torch.arange(first, seq_k, 64)
    return (torch.nonzero(rows % length < successive_rows).flatten()
            .to(device, non_blocking=True))


def kv_accumulators(k_rot: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed float32 sums of dK and dV for every key row of k_rot, v [b, s_k, hk, d] in FA4's
    SM90 accumulator layout ([b, hk, rows * d'], rows and d' rounded up to FA4's tiles), for
    GQA: every `backward` call (a piece of query rows) adds its share in the kernel, and
    `store_kv` converts the sums once."""
    batch, seq_k, heads_kv, head_dim = k_rot.shape
    cfg, multiple = _accumulator_layout(head_dim, v.shape[3])
    rows = -(-seq_k // cfg.n_block_size) * cfg.n_block_size
    return tuple(torch.zeros(batch, heads_kv, rows * -(-dim // multiple) * multiple,
                             dtype=torch.float32, device=k_rot.device)
                 for dim in (head_dim, v.shape[3]))


def store_kv(sums: tuple[torch.Tensor, torch.Tensor], dk: torch.Tensor, dv: torch.Tensor,
             scale: float) -> None:
    """dk (times the softmax scale) and dv [b, s_k, hk, d] (views with a unit last stride),
    from kv_accumulators' sums: FA4's postprocess, one rounding."""
    from flash_attn.cute import interface as fa  # with FA4 only

    cfg, multiple = _accumulator_layout(dk.shape[3], dv.shape[3])
    for accum, grad, grad_scale in ((sums[0], dk, scale), (sums[1], dv, 1.0)):
        fa._bwd_postprocess_convert(accum, grad, grad_scale, None, None, 90,
                                    fa.torch2cute_dtype_map[grad.dtype], grad.shape[3],
                                    cfg.n_block_size, cfg.num_wg * 128, cfg.AtomLayoutNdKV,
                                    cfg.dKV_swapAB, fake_mode=False, hdim_multiple_of=multiple)


def _accumulator_layout(head_dim: int, head_dim_v: int):  # noqa: ANN202
    """FA4's SM90 causal backward configuration at these head dims, and the multiple its
    float32 accumulators round the head dim up to."""
    from flash_attn.cute import interface as fa  # with FA4 only

    cfg = fa._tile_size_bwd_sm90(head_dim, head_dim_v, True, False)
    return cfg, 64 if cfg.dKV_swapAB else 32


@functools.cache
def _kernel_class(add_dkv: bool = False) -> type:
    """DCABackwardSm90, defined on first use (it subclasses FA4's kernel); add_dkv: its
    subclass whose dK/dV stores add to what is there (`_reduce_add_call`)."""
    if add_dkv:
        base = _kernel_class()
        return type("DCABackwardAddSm90", (base,), {"__call__": _reduce_add_call(base)})
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.named_barrier import NamedBarrierBwd
    from quack import copy_utils

    class DCABackwardSm90(fa4_parts.parts_mixin(), FlashAttentionBackwardSm90):
        """FA4's SM90 causal backward; Q and the dQ accumulator per block from its DCA part."""

        def __init__(self, *args, length: int, parts: int, successive_rows: int,
                     **kwargs) -> None:
            super().__init__(*args, **kwargs)
            assert self.is_causal and not self.is_local and not self.deterministic
            self.set_parts(length, parts, successive_rows)

        @cute.jit
        def load(self, mQ, mK, mV, mdO, mLSE, mdPsum, sQ, sK, sV, sdO, sLSE, sdPsum,
                 tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, pipeline_Q, pipeline_dO,
                 block_info, SeqlenInfoCls, TileSchedulerCls, blocksparse_tensors=None,
                 qhead_per_kvhead_divmod=None):
            # FA4's dense, non-varlen producer (flash_bwd_sm90.py), Q's batch coordinate
            # being part * batches + batch_idx
            warp_idx_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
            if warp_idx_in_wg == 0:
                producer_state_Q = cutlass.pipeline.make_pipeline_state(
                    cutlass.pipeline.PipelineUserType.Producer, self.Q_stage)
                producer_state_dO = cutlass.pipeline.make_pipeline_state(
                    cutlass.pipeline.PipelineUserType.Producer, self.dO_stage)
                batches = cute.size(mK.shape[3])
                scheduler = TileSchedulerCls()
                tile = scheduler.initial_work_tile_info()
                while tile.is_valid_tile:  # one key tile (n block) of one head at a time
                    n_block, head_idx, batch_idx, _ = tile.tile_idx
                    seqlen = SeqlenInfoCls(batch_idx)
                    head_idx_kv = (head_idx if cutlass.const_expr(self.qhead_per_kvhead == 1)
                                   else head_idx // qhead_per_kvhead_divmod)
                    gK = cute.local_tile(mK[None, None, head_idx_kv, batch_idx],
                                         (self.tile_n, self.tile_hdim), (n_block, 0))
                    gV = cute.local_tile(mV[None, None, head_idx_kv, batch_idx],
                                         (self.tile_n, self.tile_hdimv), (n_block, 0))
                    gdO = cute.local_tile(mdO[None, None, head_idx, batch_idx],
                                          (self.tile_m, self.tile_hdimv), (None, 0))
                    gLSE = cute.local_tile(mLSE[None, head_idx, batch_idx], (self.tile_m,),
                                           (None,))
                    gdPsum = cute.local_tile(mdPsum[None, head_idx, batch_idx], (self.tile_m,),
                                             (None,))
                    load_K, _, _ = copy_utils.tma_get_copy_fn(
                        tma_atom_K, 0, cute.make_layout(1), gK, sK, single_stage=True)
                    load_V, _, _ = copy_utils.tma_get_copy_fn(
                        tma_atom_V, 0, cute.make_layout(1), gV, sV, single_stage=True)
                    # LSE rides on Q's barrier, dPsum on dO's
                    load_LSE = self._row_stat_loader(gLSE, sLSE, pipeline_Q)
                    load_dPsum = self._row_stat_loader(gdPsum, sdPsum, pipeline_dO)
                    load_dO = copy_utils.tma_producer_copy_fn(
                        copy_utils.tma_get_copy_fn(tma_atom_dO, 0, cute.make_layout(1), gdO,
                                                   sdO)[0], pipeline_dO)
                    m_block_min, m_block_max = block_info.get_m_block_min_max(seqlen, n_block)
                    for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                        part = self.part_of(seqlen, m_block, n_block)
                        gQ = cute.local_tile(mQ[None, None, head_idx, part * batches + batch_idx],
                                             (self.tile_m, self.tile_hdim), (None, 0))
                        load_Q, _, _ = copy_utils.tma_get_copy_fn(
                            tma_atom_Q, 0, cute.make_layout(1), gQ, sQ)
                        load_Q = copy_utils.tma_producer_copy_fn(load_Q, pipeline_Q)
                        state_dO = (producer_state_dO
                                    if cutlass.const_expr(self.Q_stage != self.dO_stage)
                                    else producer_state_Q)
                        if m_block == m_block_min:  # K rides with the first Q, V with its dO
                            pipeline_Q.producer_acquire(
                                producer_state_Q, extra_tx_count=self.tma_copy_bytes["K"])
                            load_K(tma_bar_ptr=pipeline_Q.producer_get_barrier(producer_state_Q))
                            load_Q(m_block, producer_state=producer_state_Q)
                            cute.arch.griddepcontrol_wait()  # the preprocess's LSE and dPsum
                            load_LSE(m_block, producer_state=producer_state_Q)
                            pipeline_dO.producer_acquire(
                                state_dO, extra_tx_count=self.tma_copy_bytes["V"])
                            load_V(tma_bar_ptr=pipeline_dO.producer_get_barrier(state_dO))
                        else:
                            pipeline_Q.producer_acquire(producer_state_Q)
                            load_Q(m_block, producer_state=producer_state_Q)
                            load_LSE(m_block, producer_state=producer_state_Q)
                            pipeline_dO.producer_acquire(state_dO)
                        load_dO(m_block, producer_state=state_dO)
                        load_dPsum(m_block, producer_state=state_dO)
                        producer_state_Q.advance()
                        producer_state_dO.advance()
                    scheduler.prefetch_next_work()
                    scheduler.advance_to_next_work()
                    tile = scheduler.get_current_work()

        @staticmethod
        def _row_stat_loader(gmem, smem, pipe):
            """A bulk copy of one m block's row statistic (LSE or dPsum) from `gmem` into
            `smem`, counted on `pipe`'s barrier: call it with (m_block, producer_state=...)."""
            return copy_utils.tma_producer_copy_fn(
                copy_utils.cpasync_bulk_get_copy_fn(gmem, smem), pipe)

        @cute.jit
        def dQaccum_store(self, mdQaccum, sdQaccum, block_info, TileSchedulerCls,
                          SeqlenInfoCls, blocksparse_tensors=None, mdQ_semaphore=None):
            # FA4's non-deterministic dQ store, into the block's part's accumulator
            batches = cute.size(mdQaccum.shape[2]) // self.parts
            scheduler = TileSchedulerCls()
            tile = scheduler.initial_work_tile_info()
            while tile.is_valid_tile:
                n_block, head_idx, batch_idx, _ = tile.tile_idx
                seqlen = SeqlenInfoCls(batch_idx)
                m_block_min, m_block_max = block_info.get_m_block_min_max(seqlen, n_block)
                for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                    part = self.part_of(seqlen, m_block, n_block)
                    # ((M * K / num_wg_dQ, num_wg_dQ), num_m_blocks)
                    gdQaccum = cute.local_tile(
                        mdQaccum[None, head_idx, part * batches + batch_idx],
                        (cute.make_layout((self.tile_m * self.tile_hdim // self.num_wg_dQ,
                                           self.num_wg_dQ)),),
                        (None,))
                    for wg in cutlass.range_constexpr(self.num_wg_dQ):
                        cute.arch.cp_async_bulk_wait_group(self.num_wg_dQ - 1 - wg, read=True)
                        cute.arch.barrier_arrive(
                            barrier_id=int(NamedBarrierBwd.dQEmptyWG0) + wg,
                            number_of_threads=self.num_threads_per_warp_group
                            + cute.arch.WARP_SIZE)
                    for wg in cutlass.range_constexpr(self.num_wg_dQ):
                        cute.arch.barrier(
                            barrier_id=int(NamedBarrierBwd.dQFullWG0) + wg,
                            number_of_threads=self.num_threads_per_warp_group
                            + cute.arch.WARP_SIZE)
                        with cute.arch.elect_one():
                            copy_utils.cpasync_reduce_bulk_add_f32(
                                sdQaccum[None, wg].iterator,
                                gdQaccum[(None, wg), m_block].iterator,
                                self.tma_copy_bytes["dQ"])
                        cute.arch.cp_async_bulk_commit_group()
                scheduler.advance_to_next_work()
                tile = scheduler.get_current_work()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    return DCABackwardSm90


_SOURCE = fa4_parts.source_key(__file__)


def _compiled(dtype, head_dim: int, head_dim_v: int, qhead_per_kvhead: int, length: int,
              parts: int, successive_rows: int, add_dkv: bool,
              tensors: tuple[torch.Tensor, ...], scale: float):
    """The compiled kernel for this configuration (shapes are dynamic: one compile serves every
    sequence length and batch); add_dkv: its dK/dV stores add to what is there."""
    cache = fa4_parts.compile_cache("dca_bwd")
    key = (_SOURCE, dtype, head_dim, head_dim_v, qhead_per_kvhead, length, parts,
           successive_rows, add_dkv)
    if key not in cache:
        import cutlass.cute as cute
        from flash_attn.cute import interface as fa

        cfg, _ = _accumulator_layout(head_dim, head_dim_v)
        kernel = _kernel_class(add_dkv)(
            dtype, head_dim, head_dim_v, qhead_per_kvhead, True, is_local=False,
            deterministic=False, tile_m=cfg.m_block_size, tile_n=cfg.n_block_size,
            Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS,
            SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB,
            AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV,
            AtomLayoutMdQ=cfg.AtomLayoutMdQ, num_threads=(cfg.num_wg + 1) * 128,
            V_in_regs=False, q_subtile_factor=2, dQ_single_wg=cfg.dQ_single_wg,
            length=length, parts=parts, successive_rows=successive_rows)
        cute_tensors = [fa.to_cute_tensor(t) for t in tensors]
        cache[key] = cute.compile(
            kernel, *cute_tensors, scale, None, None, None, None, None, None, None, None,
            None, fa.AuxData(None, None), None, None,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options="--enable-tvm-ffi")
    return cache[key]


def _reduce_add_call(kernel_class: type):  # noqa: ANN202
    """FA4's SM90 backward `__call__` for `kernel_class`, with dK and dV stored by TMA
    reduce-adds (cp.reduce.async.bulk.tensor .add, bf16/fp16) in place of plain TMA stores, so
    the backward's later pieces add their dK/dV to the earlier pieces' in place.

    That __call__ builds the dK/dV stores from `cpasync.CopyBulkTensorTileS2GOp()` and nothing
    else from that op, so this is its code with its own globals: FA4's module's, `cpasync` a
    copy whose tile store is the reduce-add one. FA4's module is left as it is (other kernels
    compiling meanwhile see the plain stores); the DSL traces this function from FA4's source
    in those globals (it reads `__globals__`)."""
    import cutlass.cute as cute
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    assert issubclass(kernel_class, FlashAttentionBackwardSm90)
    assert "__call__" not in vars(kernel_class)  # FA4's is the one to copy
    function = inspect.unwrap(FlashAttentionBackwardSm90.__call__)
    code = getattr(function, "_original_code", function.__code__)  # the DSL's before rewriting
    scope = dict(function.__globals__)
    tma = scope["cpasync"]
    if "CopyBulkTensorTileS2GOp" not in code.co_names or not hasattr(
            tma, "CopyReduceBulkTensorTileS2GOp"):
        raise RuntimeError("FA4's SM90 backward no longer builds its dK/dV stores as "
                           "models/attention/fa4_api.py records: the DCA backward kernel "
                           "cannot add them")
    scope["cpasync"] = types.SimpleNamespace(
        **{**vars(tma), "CopyBulkTensorTileS2GOp": tma.CopyReduceBulkTensorTileS2GOp})
    own = types.FunctionType(code, scope, function.__name__, function.__defaults__,
                             function.__closure__)
    own.__kwdefaults__ = function.__kwdefaults__
    own.__annotations__ = dict(function.__annotations__)
    own.__qualname__, own.__module__ = function.__qualname__, function.__module__
    return cute.jit(own)
