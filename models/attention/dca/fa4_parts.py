"""What DCA's two FA4 kernels (fa4_forward.py, fa4_backward.py) share: the part each (query
block, key block) pair meets in, as a mixin both kernel classes inherit, and the compile cache
they are kept in.

No postponed annotations here: the CuTe DSL reads the annotations of what it compiles.
"""

import functools
import hashlib
from pathlib import Path

_THIS_SOURCE = Path(__file__).read_bytes()


@functools.cache
def parts_mixin() -> type:
    """DCAParts, defined on first use (it needs the CuTe DSL, imported with FA4)."""
    import cutlass
    import cutlass.cute as cute

    class DCAParts:
        """DCA's part of a kernel's (query block m, key block n) pair: the chunk distance, 0
        intra, 1 successive, 2 and more inter (the last of `parts` parts takes every farther
        chunk), except that a query block past its chunk's first `successive_rows` rows takes
        its successive tiles from the inter copy (the same rotation there: DCAPlan's
        successive_rows). The kernel's tile_m and tile_n must divide the chunk length L and
        tile_m successive_rows."""

        def set_parts(self, length: int, parts: int, successive_rows: int) -> None:
            self.parts = parts
            self.m_blocks_per_chunk = length // self.tile_m
            self.n_blocks_per_chunk = length // self.tile_n
            self.successive_m_blocks = successive_rows // self.tile_m

        @cute.jit
        def query_chunk(self, seqlen, m_block):
            """The chunk of query block m. The queries are the last seqlen_q of the seqlen_k
            rows (causal's bottom-right alignment), so query block m is block
            m + (seqlen_k - seqlen_q) / tile_m of all."""
            m_first = (seqlen.seqlen_k - seqlen.seqlen_q) // self.tile_m
            return (m_first + m_block) // self.m_blocks_per_chunk

        @cute.jit
        def successive_shared(self, seqlen, m_block):
            """1 where query block m reads its successive tiles from the inter copy (it lies
            past its chunk's first successive_rows rows), else 0."""
            m_first = (seqlen.seqlen_k - seqlen.seqlen_q) // self.tile_m
            in_chunk = (m_first + m_block) % self.m_blocks_per_chunk
            return cutlass.min(cutlass.max(in_chunk - self.successive_m_blocks + 1, 0), 1)

        @cute.jit
        def part_of(self, seqlen, m_block, n_block):
            """The part query block m meets key block n in: the chunk distance, capped at the
            last part, the successive one moved to inter where it is shared."""
            distance = self.query_chunk(seqlen, m_block) - n_block // self.n_blocks_per_chunk
            shared = self.successive_shared(seqlen, m_block) * cutlass.min(distance, 1)
            return cutlass.min(distance + shared, self.parts - 1)

    return DCAParts


def source_key(path: str) -> str:
    """A fingerprint of a kernel's file and this one, for its compile cache's keys (a change to
    either compiles anew)."""
    return hashlib.sha256(Path(path).read_bytes() + _THIS_SOURCE).hexdigest()[:16]


@functools.cache
def compile_cache(name: str):  # noqa: ANN201
    """FA4's JIT cache `name` (on disk across runs where FA4's is, as kernels.py sets it up), its
    entries fingerprinted by FA4's sources and, through their keys, by `source_key`."""
    from flash_attn.cute.cache_utils import get_jit_cache
    return get_jit_cache(name)
