"""Each generated token's scores and logits, as `generate(output_scores=True, output_logits=True)` returns them.

transformers returns, per generation step, the (B, V) logits the target gave for the next token (`logits`,
float32, unprocessed) and the scores it chose from (`scores`: after the logits processors, and after the sampling
warpers when sampling). A speculative round emits several tokens at once; token k of a round was chosen at node
path[k] of the verified tree (the root for the first drafted token, the deepest accepted node for the bonus), so
its step's logits are that node's, processed with that node's own sequence. The values are the target's own up to
floating-point noise (one tree forward instead of one forward per token).
"""

from __future__ import annotations

import torch
from transformers.generation import GenerateDecoderOnlyOutput

from specheads.inference.sampling import SamplingParams
from specheads.inference.sequence_processors import SequenceContext
from specheads.inference.tree import TreeBuffers


class StepRecorder:
    """One row's (V,) float32 logits and scores per emitted token, in emission order."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.logits: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, scores: torch.Tensor, count: int) -> None:
        """Keep the first `count` rows of (k, V) logits and their processed scores (the tokens emitted)."""
        # copies: the fast path's logits are views of buffers the next forward overwrites
        self.logits.extend(logits[:count].to(torch.float32, copy=True).unbind(0))
        self.scores.extend(scores[:count].to(torch.float32, copy=True).unbind(0))

    def warped(self, scores: torch.Tensor) -> torch.Tensor:
        """Sampling scores go through the warpers too (temperature, top-k, ...), as in transformers; with the
        generation config's `renormalize_logits`, then through a log-softmax (its LogitNormalization, applied last)."""
        scores = self.params.warpers()(None, scores) if self.params.do_sample else scores
        return scores.log_softmax(dim=-1) if self.params.renormalize_logits else scores

    def add_path(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        tree: TreeBuffers,
        path: torch.Tensor,
        context: SequenceContext | None,
        count: int,
    ) -> None:
        """The steps of a round's emitted tokens: the (N, V) tree logits at the (L+1,) path nodes."""
        raw = logits[path].float()  # (L+1, V)
        if context is None:
            scores = raw  # `add` copies both
        else:  # node by node: each has its own depth, hence its own sequence length
            scores = torch.cat([context.nodes(logits, tokens, tree, [node]) for node in path[:count].tolist()])
        self.add(raw, self.warped(scores), count)


def generate_output(
    sequences: torch.Tensor, recorders: list[StepRecorder], output_scores: bool, output_logits: bool
) -> GenerateDecoderOnlyOutput:
    """transformers' output object; steps past a row's end (rows that stopped early) hold -inf."""

    def stacked(name: str) -> tuple[torch.Tensor, ...]:
        per_row = [getattr(r, name) for r in recorders]
        steps = max(len(values) for values in per_row)
        vocab = next(values[0].shape[0] for values in per_row if values) if steps else 0
        filler = torch.full((vocab,), -float("inf"), device=sequences.device)
        return tuple(
            torch.stack([values[s].to(sequences.device) if s < len(values) else filler for values in per_row])
            for s in range(steps)
        )

    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=stacked("scores") if output_scores else None,
        logits=stacked("logits") if output_logits else None,
    )
