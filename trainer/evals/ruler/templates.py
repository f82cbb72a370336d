"""RULER's prompt strings, and the two prompt formats a task's text is wrapped in.

The task templates, answer prefixes and token budgets are RULER's (NVIDIA/RULER,
scripts/data/synthetic/constants.py, Apache-2.0), character for character; only the common-words
task's "10" is a `{num_cw}` field here, so a spec with another number of common words says so
(with 10 the strings are RULER's).

Prompt formats (what the model is given; the answer prefix always comes last, after any chat
wrapping, as RULER appends it to every model template):

    base: <task text><answer prefix>                     RULER's 'base' template
    chat: <chat template rendered over one user message holding the task text, with the
          generation prompt><answer prefix>
    auto: chat when a chat template is given, else base

The chat template is a Hugging Face Jinja template (its string: `load_chat_template` reads it
from a model directory), rendered here with jinja2 the way transformers renders it (sandboxed,
`trim_blocks`, `lstrip_blocks`, `loopcontrols`, `raise_exception`, `tojson`). Whatever it adds (a
system prompt, role markers) counts toward the length like the rest of the prompt.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import numpy as np

from trainer.errors import UserError

# Haystacks and needles (RULER's niah.py / variable_tracking.py).
NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
         "There and back again.")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DOCUMENT = "Document {i}:\n{document}"
# The 40 needle depths (percent of the haystack's sentences): 0, 3, 5, 8, ..., 97, 100.
DEPTHS = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
    "all the special magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
    "above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, "
             "{num_v} variables are assigned the value {query}, they are: ")

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the {num_cw} most "
    "common words in the above list?")
CWE_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
    "Please ignore the dots '....'. What are the three most frequently appeared words in the "
    "above coded text?")
FWE_PREFIX = (" Answer: According to the coded text above, the three most frequently appeared "
              "words are:")

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the "
    "question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {query}")
QA_PREFIX = " Answer:"

# Tokens each task leaves for the answer: prompt tokens + these <= the tested length.
TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120,
                      "freq_words_extraction": 50, "qa": 32}


def singular_niah(template: str) -> str:
    """RULER's rewording of the niah strings when exactly one value is asked for."""
    for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"),
                             ("answers", "answer")):
        template = template.replace(plural, singular)
    return template


FORMATS = ("base", "chat", "auto")


def _raise(message: str) -> None:
    raise UserError(f"chat template: {message}")


def _tojson(value, indent=None, ensure_ascii=False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@functools.lru_cache(maxsize=8)
def _compiled(chat_template: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(chat_template)
    except TemplateError as e:
        raise UserError(f"the chat template does not parse as Jinja: {e}") from None


def render_chat(chat_template: str, user_text: str,
                variables: Mapping[str, str] | None = None) -> str:
    """`chat_template` rendered over one user message, with the generation prompt.

    `variables` are extra names the template may use (`bos_token`, `eos_token`, ...)."""
    from jinja2 import TemplateError

    try:
        return _compiled(chat_template).render(
            messages=[{"role": "user", "content": user_text}], add_generation_prompt=True,
            **dict(variables or {}))
    except TemplateError as e:
        raise UserError(f"the chat template failed to render: {e}") from None


class PromptFormat:
    """How a task's text becomes the model's prompt: `base` or `chat` (see the module doc)."""

    def __init__(self, template: str = "auto", chat_template: str | None = None,
                 variables: Mapping[str, str] | None = None) -> None:
        if template not in FORMATS:
            raise UserError(f"unknown prompt template {template!r}: expected one of {FORMATS}")
        if template == "chat" and not chat_template:
            raise UserError("prompt template 'chat' needs the tokenizer's chat template (none "
                            "given; load_chat_template reads it from a model directory)")
        self.kind = "chat" if template == "chat" or (template == "auto" and chat_template) \
            else "base"
        self.chat_template = chat_template if self.kind == "chat" else None
        self.variables = dict(variables or {})
        if self.chat_template is not None:
            render_chat(self.chat_template, "probe", self.variables)  # fail early on a bad one
        digest = hashlib.sha256(json.dumps([self.chat_template, sorted(self.variables.items())])
                                .encode()).hexdigest()[:16]
        self.key = (self.kind, digest)  # what a fitted haystack size depends on

    def render(self, text: str, answer_prefix: str) -> str:
        """The full prompt: `text` (wrapped as a user message under `chat`) + `answer_prefix`."""
        if self.chat_template is None:
            return text + answer_prefix
        return render_chat(self.chat_template, text, self.variables) + answer_prefix


def load_chat_template(tokenizer_dir: str | Path) -> str | None:
    """The chat template of a Hugging Face tokenizer directory: `chat_template.jinja`, else
    `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: the one
    named "default", else the first); None when the directory has none."""
    directory = Path(tokenizer_dir)
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (json.JSONDecodeError, AttributeError) as e:
        raise UserError(f"{config}: not a JSON object ({e})") from None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) and template else None
