"""Dual Chunk Attention's forward as one kernel: FlashAttention-4's SM90 causal forward, the
query tile reloaded where its key loop crosses into the next part.

DCA is one softmax over a query's keys, only its query rotated differently per part (the chunk
distance: 0 intra, 1 successive, >= 2 inter). FA4's causal forward walks a query tile's key
blocks from the diagonal down to block 0, so it meets the parts in order: its own chunk's blocks
(intra, the diagonal masked), the previous chunk's (successive), then every older one (inter).
This kernel is that forward with the query tile taken from its part's rotated copy (q_rot
[parts * b, s, hq, d], the part the batch coordinate) and reloaded twice at most, when the loop
crosses a part boundary: the consumers release the tile once the previous part's last Q K^T has
completed, and the producer then loads the next part's. The online softmax runs on across the
boundary, so the output and the LSE leave the kernel merged: no part calls, no merge. A query
block past its chunk's first `successive_rows` rows reads its successive tiles from the inter
copy (the same rotation there, DCAPlan.successive_rows), so its loop crosses one boundary.

The queries may be the last rows of the keys' (FA4's bottom-right causal alignment; those rows'
out and lse are then complete), as in the backward kernel; grouped.forward passes all rows at
once. Needs the chunk length L and the query and key rows to be multiples of 128 (the tile:
every tile lies in one chunk and only the diagonal one is masked). FA4 (and its CuTe DSL) is
imported on first use; `forward` is called only where dispatch.kernel_refusal finds nothing.
"""

import functools

import torch

from models.attention.dca import fa4_parts
from models.attention.dca.plan import KERNEL_BLOCK  # the query and key tile, fixed


def forward(q_rot: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor, scale: float,
            length: int, successive_rows: int, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Writes DCA's output into out [b, s_q, hq, d] and its LSE into lse [b, hq, s_q] (float32;
    both may be views of larger tensors), for queries that are the last s_q of the s_k key rows.

    q_rot: [p * b, s_q, hq, d] part-major, each part's rotated queries (the successive copy
    read only in each chunk's first `successive_rows` rows, DCAPlan.successive_rows); k_rot,
    v: [b, s_k, hk, d]; length: the chunk length L. L, s_q, s_k and successive_rows must be
    multiples of 128.
    """
    from flash_attn.cute import interface as fa  # with FA4 only

    batch, seq, heads, head_dim = out.shape
    seq_k, heads_kv = k_rot.shape[1], k_rot.shape[2]
    parts = q_rot.shape[0] // batch
    if (any(n % KERNEL_BLOCK for n in (length, successive_rows, seq, seq_k))
            or seq > seq_k or head_dim > 128):
        raise ValueError(f"the DCA forward kernel needs L ({length}), the successive rows "
                         f"({successive_rows}) and the query ({seq}) and key ({seq_k}) rows to "
                         f"be multiples of {KERNEL_BLOCK}, queries <= keys, head_dim <= 128 (got "
                         f"{head_dim})")
    q_rot, k_rot, v = (fa.maybe_contiguous(t) for t in (q_rot, k_rot, v))
    dtype = fa.torch2cute_dtype_map[q_rot.dtype]
    kernel = _compiled(dtype, head_dim, v.shape[3], heads // heads_kv, length, parts,
                       successive_rows, (q_rot, k_rot, v, out, lse))
    kernel(q_rot.detach(), k_rot.detach(), v.detach(), out, lse, scale)


@functools.cache
def _kernel_class() -> type:
    """DCAForwardSm90, defined on first use (it subclasses FA4's kernel)."""
    from functools import partial
    from types import SimpleNamespace

    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr, pipeline
    from cutlass.cute.nvgpu import cpasync
    from cutlass.utils import LayoutEnum
    from flash_attn.cute import utils
    from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.softmax import Softmax
    from flash_attn.cute.tile_scheduler import SingleTileLPTScheduler, TileSchedulerArguments
    from quack import copy_utils, layout_utils, sm90_utils

    class DCAForwardSm90(fa4_parts.parts_mixin(), FlashAttentionForwardSm90):
        """FA4's SM90 causal forward; the query tile per key block from its DCA part."""

        def __init__(self, *args, length: int, parts: int, successive_rows: int,
                     **kwargs) -> None:
            super().__init__(*args, **kwargs)
            assert self.is_causal and not self.is_local and not self.pack_gqa
            assert self.intra_wg_overlap and self.tile_m == self.tile_n == KERNEL_BLOCK
            self.set_parts(length, parts, successive_rows)

        # annotations evaluated here (no postponed evaluation in this file): the DSL reads them
        @cute.jit
        def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                     mLSE: cute.Tensor, softmax_scale: Float32, stream=None):
            # FA4's __call__ (flash_fwd_sm90.py) for dense, non-varlen TMA loads, with one
            # change: the grid covers O's batch, not Q's (parts x batch)
            self._check_type(mQ.element_type, mK.element_type, mV.element_type,
                             mO.element_type, mLSE.element_type, None, None, None, None)
            self.varlen_q = False
            mQ, mK, mV, mO = [assume_tensor_aligned(t) for t in (mQ, mK, mV, mO)]
            # [b, s, h, d] -> (s, d, h, b); lse [b, h, s] -> (s, h, b)
            mQ, mO, mK, mV = [layout_utils.select(t, [1, 3, 2, 0]) for t in (mQ, mO, mK, mV)]
            mLSE = layout_utils.select(mLSE, [2, 1, 0])
            tiled_mma_qk, tiled_mma_pv = self._get_tiled_mma()
            self._set_threads(tiled_mma_qk.size)
            self.use_block_sparsity = False
            self.use_scheduler_barrier = self.num_wg_mma >= 2 and self.tile_hdim <= 128
            self.use_tma_Q = self.use_tma_O = True
            self.rescale_O_before_gemm = self.tile_hdimv > 128
            self._setup_attributes()
            self._set_smem_layouts(mQ.element_type, mK.element_type, mV.element_type,
                                   mO.element_type)
            SharedStorage = self._get_shared_storage_cls()
            self.tma_copy_bytes = {
                name: cute.size_in_bytes(mX.element_type, cute.select(layout, mode=[0, 1]))
                for name, mX, layout in [("Q", mQ, self.sQ_layout), ("K", mK, self.sK_layout),
                                         ("V", mV, self.sV_layout)]
            }
            load_op, store_op = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_Q, tma_tensor_Q = cpasync.make_tiled_tma_atom(
                load_op, mQ, self.sQ_layout, (self.tile_m, self.tile_hdim))
            tma_atom_K, tma_tensor_K = cpasync.make_tiled_tma_atom(
                load_op, mK, cute.select(self.sK_layout, mode=[0, 1]),
                (self.tile_n, self.tile_hdim), 1)
            tma_atom_V, tma_tensor_V = cpasync.make_tiled_tma_atom(
                load_op, mV, cute.select(self.sV_layout, mode=[0, 1]),
                (self.tile_n, self.tile_hdimv), 1)
            tma_atom_O, tma_tensor_O = cpasync.make_tiled_tma_atom(
                store_op, mO, self.sO_layout, (self.tile_m, self.tile_hdimv))
            tile_sched_args = TileSchedulerArguments(
                cute.ceil_div(cute.size(mO.shape[0]), self.tile_m),
                cute.size(mO.shape[2]),
                cute.size(mO.shape[3]),
                1,  # num_splits
                cute.size(mK.shape[0]),
                mQ.shape[1],
                mV.shape[1],
                total_q=cute.size(mO.shape[0]) * cute.size(mO.shape[3]),
                tile_shape_mn=(self.tile_m, self.tile_n),
                mCuSeqlensQ=None,
                mSeqUsedQ=None,
                qhead_per_kvhead_packgqa=1,
                element_size=self.dtype.width // 8,
                is_persistent=False,
                lpt=True,
                cu_total_m_blocks_ptr=None,
                cu_total_splits_m_blocks_ptr=None,
            )
            tile_sched_params = SingleTileLPTScheduler.to_underlying_arguments(tile_sched_args)
            grid_dim = SingleTileLPTScheduler.get_grid_shape(tile_sched_params)
            softmax_scale_log2, softmax_scale = utils.compute_softmax_scale_log2(
                softmax_scale, None)
            self.kernel(
                tma_tensor_Q, tma_tensor_K, tma_tensor_V, tma_tensor_O, mLSE,
                None, None, None, None, None,  # cu_seqlens q/k, seqused q/k, page table
                tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
                softmax_scale_log2, softmax_scale,
                None, None, None, None,  # window sizes, learnable sink, block sparsity
                self.sQ_layout, self.sK_layout, self.sV_layout, self.sO_layout,
                self.sP_layout, self.gmem_tiled_copy_Q, self.gmem_tiled_copy_K,
                self.gmem_tiled_copy_V, self.gmem_tiled_copy_O, tiled_mma_qk, tiled_mma_pv,
                tile_sched_params, SingleTileLPTScheduler, SharedStorage,
                utils.AuxData(), None,
            ).launch(grid=grid_dim, block=[self.num_threads, 1, 1], stream=stream,
                     min_blocks_per_mp=1)

        def _set_threads(self, mma_threads: int) -> None:
            """The block's threads: `mma_threads` consumers (whole warp groups, which also run
            the epilogue) and one producer warp group, of which one warp issues the TMA loads;
            the registers per thread each side gets (setmaxnreg), by consumer group count."""
            group = 128  # threads in a warp group
            self.num_threads_per_warp_group = self.num_Q_load_threads = group
            self.num_mma_threads = self.num_epilogue_threads = mma_threads
            self.num_wg_mma = mma_threads // group
            self.num_threads = mma_threads + group
            self.num_producer_threads = cute.arch.WARP_SIZE
            consumer_regs, producer_regs = {1: (256, 56), 2: (240, 24), 3: (160, 32)}[
                self.num_wg_mma]
            self.num_mma_regs, self.num_producer_regs = consumer_regs, producer_regs

        def _set_smem_layouts(self, q_type, k_type, v_type, o_type) -> None:
            """Row-major shared-memory tiles: Q and O one tile each, K and V `num_stages`
            tiles, P one tile unless P V reads P from registers."""
            def smem_tile(dtype, rows, cols, stages=None):
                return sm90_utils.make_smem_layout(dtype, LayoutEnum.ROW_MAJOR, (rows, cols),
                                                   stages)
            self.sO_layout = smem_tile(o_type, self.tile_m, self.tile_hdimv)
            self.sQ_layout = smem_tile(q_type, self.tile_m, self.tile_hdim)
            self.sV_layout = smem_tile(v_type, self.tile_n, self.tile_hdimv, self.num_stages)
            self.sK_layout = smem_tile(k_type, self.tile_n, self.tile_hdim, self.num_stages)
            self.sP_layout = (None if self.mma_pv_is_rs
                              else smem_tile(v_type, self.tile_m, self.tile_n))

        @cute.jit
        def load_Q(self, mQ, sQ, tma_atom_Q, pipeline_q, phase, head_idx, batch, m_block):
            """Loads query tile m_block of Q's batch entry `batch` (part * b + batch index)."""
            gQ = cute.local_tile(mQ[None, None, head_idx, batch], (self.tile_m, self.tile_hdim),
                                 (m_block, 0))
            copy_Q, _, _ = copy_utils.tma_get_copy_fn(
                tma_atom_Q, 0, cute.make_layout(1), gQ, sQ, single_stage=True)
            pipeline_q.producer_acquire_w_index_phase(0, phase)
            copy_Q(tma_bar_ptr=pipeline_q.sync_object_full.get_barrier(0))

        @cute.jit
        def load(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_k,
                 pipeline_v, pipeline_q, gmem_tiled_copy_Q, mPageTable, blocksparse_tensors,
                 block_info, SeqlenInfoCls, TileSchedulerCls):
            # FA4's producer (flash_fwd_sm90.py) for TMA loads with intra-warpgroup overlap;
            # the query tile reloaded after the first K (and the V before it) of a new part
            warp_idx_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
            if warp_idx_in_wg == 0:
                q_phase = Int32(1)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                        self.num_stages)
                batches = cute.size(mK.shape[3])
                scheduler = TileSchedulerCls()
                tile = scheduler.initial_work_tile_info()
                while tile.is_valid_tile:  # one query tile (m block) of one head at a time
                    m_block, head_idx, batch_idx, _ = tile.tile_idx
                    seqlen = SeqlenInfoCls(batch_idx)
                    head_idx_kv = head_idx // self.qhead_per_kvhead
                    gK = cute.local_tile(mK[None, None, head_idx_kv, batch_idx],
                                         (self.tile_n, self.tile_hdim), (None, 0))
                    gV = cute.local_tile(mV[None, None, head_idx_kv, batch_idx],
                                         (self.tile_n, self.tile_hdimv), (None, 0))
                    load_K, _, _ = copy_utils.tma_get_copy_fn(
                        tma_atom_K, 0, cute.make_layout(1), gK, sK)
                    load_K = copy_utils.tma_producer_copy_fn(load_K, pipeline_k)
                    load_V, _, _ = copy_utils.tma_get_copy_fn(
                        tma_atom_V, 0, cute.make_layout(1), gV, sV)
                    load_V = copy_utils.tma_producer_copy_fn(load_V, pipeline_v)
                    n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
                    pipeline_k.producer_acquire(kv_state)
                    load_K(src_idx=n_block_max - 1, producer_state=kv_state)
                    self.load_Q(mQ, sQ, tma_atom_Q, pipeline_q, q_phase, head_idx, batch_idx,
                                m_block)  # intra's copy first: the diagonal block
                    q_phase ^= 1
                    part = Int32(0)
                    for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                        n_block_prev = n_block_max - i - 1
                        n_block = n_block_prev - 1
                        kv_state_prev = kv_state.clone()
                        kv_state.advance()
                        pipeline_k.producer_acquire(kv_state)
                        load_K(src_idx=n_block, producer_state=kv_state)
                        pipeline_v.producer_acquire(kv_state_prev)
                        load_V(src_idx=n_block_prev, producer_state=kv_state_prev)
                        part_next = self.part_of(seqlen, m_block, n_block)
                        if part_next != part:  # waits for the consumers to release Q
                            self.load_Q(mQ, sQ, tma_atom_Q, pipeline_q, q_phase, head_idx,
                                        part_next * batches + batch_idx, m_block)
                            q_phase ^= 1
                            part = part_next
                    pipeline_v.producer_acquire(kv_state)
                    load_V(src_idx=n_block_min, producer_state=kv_state)
                    kv_state.advance()
                    scheduler.prefetch_next_work()
                    scheduler.advance_to_next_work()
                    tile = scheduler.get_current_work()
                pipeline_v.producer_tail(kv_state)

        @cute.jit
        def mma(self, tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, sVt, sP, sO, learnable_sink,
                pipeline_k, pipeline_v, pipeline_q, gmem_tiled_copy_O, tma_atom_O, tidx,
                softmax_scale_log2, softmax_scale, block_info, SeqlenInfoCls, AttentionMaskCls,
                TileSchedulerCls, blocksparse_tensors, aux_data, fastdiv_mods=None):
            # FA4's consumer (flash_fwd_sm90.py) with intra-warpgroup overlap and no score or
            # mask mods; at a part boundary it releases the query tile once the previous part's
            # last Q K^T is done, and waits for the next part's
            warp_group_idx = cute.arch.make_warp_uniform(tidx // self.num_threads_per_warp_group)
            # the first thread of each consumer warp group: the whole group's share of a GEMM
            group_first_thread = cute.make_layout(
                self.num_wg_mma, stride=self.num_threads_per_warp_group)(warp_group_idx)
            wg_mma_pv = tiled_mma_pv.get_slice(group_first_thread)
            wg_mma_qk = tiled_mma_qk.get_slice(group_first_thread)
            thr_mma_qk = tiled_mma_qk.get_slice(tidx)  # this thread's share (the mask's rows)
            _, tSrQ, tSrK = sm90_utils.partition_fragment_ABC(
                wg_mma_qk, (self.tile_m, self.tile_n, self.tile_hdim), sQ, sK)
            mma_qk_fn = partial(sm90_utils.gemm_zero_init, tiled_mma_qk,
                                (self.tile_m, self.tile_n), tSrQ, tSrK)
            acc_O, tOrP, tOrVt = sm90_utils.partition_fragment_ABC(
                wg_mma_pv, (self.tile_m, self.tile_hdimv, self.tile_n), sP, sVt)
            # O accumulates from a zeroed start (acc_O.fill below), so every P V adds
            mma_pv_fn = partial(sm90_utils.gemm_w_idx, tiled_mma_pv, acc_O, tOrP, tOrVt,
                                zero_init=False)
            smem_copy_atom_P = utils.get_smem_store_atom(self.arch.major * 10 + self.arch.minor,
                                                         self.dtype)
            smem_thr_copy_P = cute.make_tiled_copy_C(smem_copy_atom_P,
                                                     tiled_mma_qk).get_slice(tidx)
            tPsP = smem_thr_copy_P.partition_D(sP) if const_expr(sP is not None) else None
            smem_copy_params = SimpleNamespace(smem_thr_copy_P=smem_thr_copy_P, tPsP=tPsP)
            self.mma_init()
            q_phase = Int32(0)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                    self.num_stages)
            scheduler = TileSchedulerCls()
            tile = scheduler.initial_work_tile_info()
            softmax = Softmax.create(softmax_scale_log2,
                                     num_rows=acc_O.shape[0][0] * acc_O.shape[1],
                                     softmax_scale=softmax_scale)
            scores_scale = None
            if const_expr(self.rescale_O_before_gemm):
                scores_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)
            while tile.is_valid_tile:
                m_block, head_idx, batch_idx, _ = tile.tile_idx
                seqlen = SeqlenInfoCls(batch_idx)
                mask = AttentionMaskCls(seqlen)
                mask_fn = partial(mask.apply_mask, batch_idx=batch_idx, head_idx=head_idx,
                                  m_block=m_block, thr_mma=thr_mma_qk, mask_causal=True,
                                  mask_local=False, aux_data=aux_data, fastdiv_mods=None,
                                  mask_mod=None)
                n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
                acc_O.fill(0.0)
                pipeline_q.consumer_wait_w_index_phase(0, q_phase)
                # the diagonal block (intra's, the only masked one): Q K^T and softmax
                kv_state = self.first_half_block_overlap(
                    n_block=n_block_max - 1, mma_qk_fn=mma_qk_fn, kv_consumer_state=kv_state,
                    pipeline_k=pipeline_k, tOrP=tOrP, smem_copy_params=smem_copy_params,
                    softmax=softmax, seqlen=seqlen, scores_scale=scores_scale, acc_O=acc_O,
                    mask_fn=mask_fn, is_first_block=True)
                # the other blocks, part by part (part_of's rule as ranges of key blocks; a
                # loop each, so the mainloop stays free of branches): each block's Q K^T and
                # softmax, the previous block's P V
                chunk = self.query_chunk(seqlen, m_block)
                n_block = n_block_max - 2  # the next block
                for part in cutlass.range_constexpr(self.parts):
                    n_block_low = n_block_min  # the part's lowest block: inter's is 0
                    if const_expr(part < self.parts - 1):
                        # a shared successive part has no blocks: inter takes them
                        first_chunk = chunk - part
                        if const_expr(part == 1):
                            first_chunk += self.successive_shared(seqlen, m_block)
                        n_block_low = cutlass.max(first_chunk * self.n_blocks_per_chunk,
                                                  n_block_min)
                    blocks = cutlass.max(n_block + 1 - n_block_low, 0)
                    if const_expr(part > 0):
                        if blocks > 0:  # every Q K^T of the previous part has completed
                            pipeline_q.consumer_release_w_index(0)
                            q_phase ^= 1
                            pipeline_q.consumer_wait_w_index_phase(0, q_phase)
                    for i in cutlass.range(blocks, unroll=1):
                        kv_state = self.mma_one_n_block_intrawg_overlap(
                            kv_state, n_block=n_block - i, mma_qk_fn=mma_qk_fn,
                            mma_pv_fn=mma_pv_fn, pipeline_k=pipeline_k, pipeline_v=pipeline_v,
                            acc_O=acc_O, tOrP=tOrP, smem_copy_params=smem_copy_params,
                            softmax=softmax, seqlen=seqlen, scores_scale=scores_scale,
                            check_inf=True)
                    n_block -= blocks
                pipeline_q.consumer_release_w_index(0)
                q_phase ^= 1
                kv_state = self.last_half_block_overlap(  # the last block's P V
                    kv_consumer_state=kv_state, pipeline_v=pipeline_v, mma_pv_fn=mma_pv_fn,
                    zero_init=False, scores_scale=scores_scale, softmax=softmax, acc_O=acc_O)
                row_scale = softmax.finalize()
                softmax.rescale_O(acc_O, row_scale)
                self.epilogue(acc_O, softmax.row_sum, mO, mLSE, sO, seqlen, gmem_tiled_copy_O,
                              tma_atom_O, tiled_mma_pv, tidx, m_block, head_idx, batch_idx)
                scheduler.advance_to_next_work()
                tile = scheduler.get_current_work()

    return DCAForwardSm90


_SOURCE = fa4_parts.source_key(__file__)


def _compiled(dtype, head_dim: int, head_dim_v: int, qhead_per_kvhead: int, length: int,
              parts: int, successive_rows: int, tensors: tuple[torch.Tensor, ...]):
    """The compiled kernel for this configuration (shapes are dynamic: one compile serves every
    sequence length and batch)."""
    cache = fa4_parts.compile_cache("dca_fwd")
    key = (_SOURCE, dtype, head_dim, head_dim_v, qhead_per_kvhead, length, parts,
           successive_rows)
    if key not in cache:
        import cutlass.cute as cute
        from flash_attn.cute import interface as fa

        # FA4's tile configuration with 128-row query tiles (block-sparse sizing: 128 x 128
        # for every head_dim <= 128)
        cfg = fa._tile_size_fwd_sm90(head_dim, head_dim_v, True, False,
                                     sparse_block_size_q=KERNEL_BLOCK)
        kernel = _kernel_class()(
            dtype, head_dim, head_dim_v, qhead_per_kvhead, is_causal=True, is_local=False,
            pack_gqa=False, tile_m=KERNEL_BLOCK, tile_n=KERNEL_BLOCK, num_stages=2, num_threads=384,
            Q_in_regs=False, intra_wg_overlap=True, mma_pv_is_rs=cfg.mma_pv_is_rs,
            length=length, parts=parts, successive_rows=successive_rows)
        q, k, v, out, lse = tensors
        cute_tensors = [fa.to_cute_tensor(t) for t in (q, k, v, out)]
        cute_tensors.append(fa.to_cute_tensor(lse, assumed_align=4))
        cache[key] = cute.compile(
            kernel, *cute_tensors, 1.0,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options="--enable-tvm-ffi")
    return cache[key]
