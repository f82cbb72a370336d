"""The decoding engine: batched generation from the trainer's own model over a static KV cache.

`DecodeEngine(model, vocab_size).generate(prompts, max_new_tokens)` is what `trainer.generate`,
`trainer.eval` (every task that decodes), the in-training suite and `bench.generate` run:

1. prompts are taken in batches of at most `max_batch`, longest first;
2. each batch is prefilled by the model's own forward (the trainer's attention kernels), rows
   right-padded to the longest: attention is causal, so a row's tokens never see the padding
   after them, and each row's logits are taken at its own last token (the output layer sees
   only those rows: no [batch, length, vocab] logits). Rows are grouped so that a forward holds
   at most `prefill_tokens` tokens; a prompt longer than that is prefilled in pieces, each
   attending to the cache (trainer/engine/cache.py);
3. the decode step, one token per row at its own position, runs as a CUDA graph captured once per
   cache shape (eagerly on the CPU); finished rows keep their slot until the batch ends.

Greedy (`temperature=0`) or sampled (temperature, top-p), seeded per prompt: a prompt's tokens do
not depend on the batch it is decoded in. Stop tokens end a row; `max_new_tokens` per prompt.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from trainer.engine.budget import LENGTH_MULTIPLE, bucket
from trainer.engine.cache import LayerCache, unwrapped
from trainer.engine.sampling import Sampler, Sampling

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs (not what it computes)."""

    max_batch: int = 16  # prompts decoded together
    prefill_tokens: int = 131072  # tokens per prefill forward (a longer prompt: in pieces)
    cuda_graphs: bool = True  # the decode step as a CUDA graph (GPU only)


@dataclass
class EngineStats:
    """What the engine has done so far: wall seconds (each ends at a host sync the decoding
    makes anyway) and tokens."""

    prefill_s: float = 0.0  # cache allocation and prefill up to the first token's pick
    decode_s: float = 0.0  # the decode steps (captures excluded)
    capture_s: float = 0.0  # capturing the decode step's graph (warm-up runs included)
    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0

    def seconds(self) -> dict[str, float]:
        """The split under the names a command's timing (trainer/timing.py) reports it."""
        return {"engine.prefill": self.prefill_s, "engine.decode": self.decode_s,
                "engine.capture": self.capture_s}


class DecodeEngine:
    """Generation from `model` (a GPTModel, or its bf16 wrapper; TP=1) in eval mode."""

    def __init__(self, model: torch.nn.Module, vocab_size: int,
                 options: EngineOptions = EngineOptions()) -> None:
        if options.max_batch < 1 or options.prefill_tokens < 1:
            raise ValueError(f"engine options must be positive: {options}")
        self.model, self.vocab_size, self.options = model, vocab_size, options
        self.gpt = unwrapped(model)
        self.device = next(self.gpt.parameters()).device
        self.cache: LayerCache | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graphs = options.cuda_graphs and self.device.type == "cuda"
        self.tokens: torch.Tensor | None = None  # the decode step's input [batch, 1]
        self.logits: torch.Tensor | None = None  # the captured step's output [batch, vocab]
        self.stats = EngineStats()

    # -- public ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 sampling: Sampling = Sampling(), stop_tokens: Sequence[int] = (),
                 progress: str | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[list[int]]:
        """The new tokens of each prompt (a stop token included, then nothing more).
        `on_tokens(i, tokens)` sees prompt i's tokens so far after every step of its batch."""
        budgets = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
                   else list(max_new_tokens))
        if len(budgets) != len(prompts) or any(b < 1 for b in budgets):
            raise ValueError("max_new_tokens: one positive count per prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        outputs: list[list[int]] = [[] for _ in prompts]
        bar = tqdm(total=len(prompts), desc=progress, leave=False, disable=progress is None)
        stops = set(int(t) for t in stop_tokens)
        with self._eval_mode():
            for start in range(0, len(order), self.options.max_batch):
                batch = order[start:start + self.options.max_batch]
                new = self._generate_batch([list(prompts[i]) for i in batch],
                                           [budgets[i] for i in batch], batch, sampling, stops,
                                           on_tokens)
                for i, tokens in zip(batch, new):
                    outputs[i] = tokens
                bar.update(len(batch))
        bar.close()
        return outputs

    def reserve(self, batch: int, length: int) -> None:
        """Allocate the cache (and so capture the graph once) for the largest batch and length
        that follow: later, smaller batches and shorter prompts decode in it."""
        self._ensure_cache(batch, length)

    def release(self) -> None:
        """Free the cache and the captured graph."""
        self.cache = self.graph = self.tokens = self.logits = None

    # -- one batch ---------------------------------------------------------------------------

    def _generate_batch(self, prompts: list[list[int]], budgets: list[int], ids: list[int],
                        sampling: Sampling, stops: set[int],
                        on_tokens: Callable[[int, list[int]], None] | None) -> list[list[int]]:
        b = len(prompts)
        lengths = [len(p) for p in prompts]
        stats = self.stats
        start = time.perf_counter()
        self._ensure_cache(b, max(n + m for n, m in zip(lengths, budgets)))
        logits = self._prefill(prompts)  # [b, vocab]
        sampler = Sampler(sampling, ids, self.device)
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * b
        pos = torch.tensor(lengths + [0] * (self.cache.batch - b), device=self.device)
        first, captured = True, stats.capture_s
        while True:
            picked = sampler(logits[:b]).tolist()  # one host sync per step
            now = time.perf_counter()
            if first:
                stats.prefill_s += now - start
                first = False
            else:
                stats.decode_s += now - start - (stats.capture_s - captured)
            for r, token in enumerate(picked):
                if not done[r]:
                    new[r].append(token)
                    done[r] = token in stops or len(new[r]) >= budgets[r]
                    if on_tokens is not None:
                        on_tokens(ids[r], new[r])
            if all(done):
                stats.prompts += b
                stats.prompt_tokens += sum(lengths)
                stats.new_tokens += sum(map(len, new))
                return new
            self.tokens[:b, 0] = torch.tensor(picked, device=self.device)
            self.cache.pos.copy_(pos)
            start, captured = time.perf_counter(), stats.capture_s
            logits = self._step()
            pos[:b] += 1

    def _ensure_cache(self, batch: int, length: int) -> None:
        """A cache of at least `batch` rows (a power of two, at most max_batch) and `length`
        positions (rounded up to LENGTH_MULTIPLE); reused while it fits, also by a smaller batch
        (its step computes the spare rows too, which costs less than a new cache and graph)."""
        rows = min(self.options.max_batch, 1 << (batch - 1).bit_length())
        length = bucket(length, LENGTH_MULTIPLE)
        c = self.cache
        if c is not None and c.batch >= rows and c.length >= length:
            return
        self.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.cache = LayerCache(self.model, rows, length)
        self.tokens = torch.zeros(rows, 1, dtype=torch.int64, device=self.device)

    # -- prefill -----------------------------------------------------------------------------

    def _prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Every prompt's keys and values cached, rows 0..; the logits after each [b, vocab]."""
        budget = self.options.prefill_tokens
        out = []
        start = 0
        while start < len(prompts):
            width = len(prompts[start])  # the longest of the rest (sorted longest first)
            # a prompt longer than the budget goes alone (prefilled in pieces)
            rows = max(1, min(len(prompts) - start, budget // width))
            group = prompts[start:start + rows]
            out.append(self._prefill_group(slice(start, start + rows), group))
            start += rows
        return torch.cat(out)

    def _prefill_group(self, slots: slice, prompts: list[list[int]]) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        tokens = torch.zeros(len(prompts), width, dtype=torch.int64, device=self.device)
        for r, p in enumerate(prompts):
            tokens[r, :len(p)] = torch.tensor(p, device=self.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        piece = self.options.prefill_tokens
        lengths = tuple(len(p) for p in prompts)  # DCA's length-dependent scaling reads them
        # the whole prompts, or the first piece of one longer than a forward may hold, through
        # the model's own attention; the other pieces each attend to the cache
        with self.cache.record(slots, lengths), self._logits_at(last.clamp(max=piece - 1)):
            logits = self._logits(tokens[:, :piece])
        for begin in range(piece, width, piece):
            end = min(width, begin + piece)
            with self.cache.extend(slots, begin, end, width), \
                    self._logits_at((last - begin).clamp(0, end - begin - 1)):
                logits = self._logits(tokens[:, begin:end])
        return logits

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, vocab] logits of the model's forward of `tokens` [b, s] (one row per sequence:
        `_logits_at` chose which position)."""
        positions = torch.arange(tokens.shape[1], device=self.device).expand_as(tokens)
        return self.model(tokens, positions, None)[:, -1, :self.vocab_size].float()

    @contextlib.contextmanager
    def _logits_at(self, index: torch.Tensor) -> Iterator[None]:
        """The output layer projects only hidden[index[b], b] of each row b."""
        layer = self.gpt.output_layer
        original = layer.forward
        rows = torch.arange(index.shape[0], device=self.device)

        def forward(hidden: torch.Tensor, *args, **kwargs):
            return original(hidden[index, rows][None], *args, **kwargs)  # [1, b, h]

        layer.forward = forward
        try:
            yield
        finally:
            del layer.forward

    # -- decode step -------------------------------------------------------------------------

    def _step(self) -> torch.Tensor:
        """Logits [batch, vocab] of the tokens in `self.tokens` at `self.cache.pos`."""
        if self.graphs and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        with self.cache.step():
            return self._logits(self.tokens)

    def _capture(self) -> None:
        """Capture the decode step (the inputs in place are this step's: the warm-up runs write
        the same keys and values the replay writes)."""
        start = time.perf_counter()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), self.cache.step():
                for _ in range(2):  # compile Triton kernels, create cuBLAS workspaces
                    self._logits(self.tokens)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with self.cache.step(), torch.cuda.graph(graph):
                self.logits = self._logits(self.tokens)
            self.graph = graph
        except Exception as err:  # noqa: BLE001  a model part that cannot be captured
            log.warning("decoding without CUDA graphs: capturing the decode step failed (%s: "
                        "%s)", type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            self.graphs, self.graph, self.logits = False, None, None
        torch.cuda.synchronize()
        self.stats.capture_s += time.perf_counter() - start

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """Eval mode, and megatron's own RoPE application (the fused RoPE kernels take a table
        of positions 0..s, not the per-row rows a decode step gathers)."""
        config, training = self.gpt.config, self.model.training
        saved = (config.apply_rope_fusion, config.fused_single_qkv_rope)
        config.apply_rope_fusion = config.fused_single_qkv_rope = False
        self.model.eval()
        try:
            yield
        finally:
            config.apply_rope_fusion, config.fused_single_qkv_rope = saved
            self.model.train(training)
