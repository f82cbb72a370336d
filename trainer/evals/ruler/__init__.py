"""A RULER-style long-context evaluation suite: inputs and scores, no decoding.

After RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", https://github.com/NVIDIA/RULER, Apache-2.0): its 13 tasks under the same
names (8 needle-in-a-haystack variants, variable tracking, common and frequent words extraction,
two QA tasks), its task templates and answer prefixes verbatim, its fitting rule (prompt tokens +
tokens_to_generate <= length) and its scores. The code is our own and offline: the essay haystack
is the caller's text (not Paul Graham's essays), words are seeded pseudo-words (or the
tokenizer's vocabulary) instead of `wonderwords`, sentences split by a regex instead of nltk,
QA data comes from a file the caller gives. Every sample is a function of (seed, task, length,
index) alone.

Modules: `specs` (task specs, registry, `Sample`), `templates` (RULER's strings, base/chat
prompt formats), `words`, `haystack`, the generators (`niah`, `variable_tracking`,
`aggregation`, `qa`), `fit` (lengths, randomness), `suite` (selection, checks, building,
JSONL), `scoring`. The model side (decoding each sample's `prompt_ids` for `max_new_tokens`) is
the caller's; `score_predictions` grades the text it produced.
"""

from trainer.evals.ruler.scoring import (
    RULER_THRESHOLD,
    SuiteResult,
    TaskScore,
    effective_length,
    sample_scores,
    score_predictions,
    string_match_all,
    string_match_part,
)
from trainer.evals.ruler.specs import (
    REGISTRY,
    CommonWordsSpec,
    FrequentWordsSpec,
    NiahSpec,
    QASpec,
    Sample,
    TaskSpec,
    VariableTrackingSpec,
    task_id,
)
from trainer.evals.ruler.suite import (
    build_samples,
    check_lengths,
    read_jsonl,
    select_tasks,
    write_jsonl,
)
from trainer.evals.ruler.templates import PromptFormat, load_chat_template, render_chat
from trainer.evals.ruler.words import word_pool

__all__ = [
    "REGISTRY", "RULER_THRESHOLD", "CommonWordsSpec", "FrequentWordsSpec", "NiahSpec",
    "PromptFormat", "QASpec", "Sample", "SuiteResult", "TaskScore", "TaskSpec",
    "VariableTrackingSpec", "build_samples", "check_lengths", "effective_length",
    "load_chat_template", "read_jsonl", "render_chat", "sample_scores", "score_predictions",
    "select_tasks", "string_match_all", "string_match_part", "task_id", "word_pool",
    "write_jsonl",
]
