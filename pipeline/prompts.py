"""How a record's control codes become the tokens before its text: the prompt.

    prompt = PromptFormat.of(cfg.data)
    ids = prompt.ids(tokenizer, control_code)     # the prompt's token ids, as every stage encodes them

Two forms. The header (`data.prompt_template` unset, for models built from scratch): the codes
joined by tabs, then a blank line ("Business Category: Bars\tReview Stars: 4.0\n\n"). A prompt
template ("Write a {sentiment} tweet to {airline}."): the codes' values fill it and, where the
tokenizer has a chat template (`data.chat_template`), it is sent as a user turn with the
assistant's turn opened after it, so that an instruction-tuned model reads it as an instruction
(issue 59: the header form made SmolLM2-Instruct write "You've been given the question: ...").
Training, generation, evaluation and the audits encode prompts here and nowhere else, so they
are identical in DP training and generation. With a template, the prompt's tokens are left out
of every loss and perplexity that measures the text (`masks_prompt`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

CODE_JOINER = "\t"
SEPARATOR = "\n\n"
PLACEHOLDER = re.compile(r"{(\w+)}")


def header(control_code: str) -> str:
    """The header form's prompt (and training prefix) for one control code."""
    return control_code + SEPARATOR


@dataclass(frozen=True)
class PromptFormat:
    template: str | None = None
    """`data.prompt_template`: None is the header form."""
    chat: bool = True
    """Render a template through the tokenizer's chat template where it has one."""
    columns: tuple[str, ...] = ()
    """The code columns, in the control code's order."""
    code_template: str = "{value}"
    """How one code is written in the control code (`data.code_template`), to read its value back."""
    system: str | None = None
    """A chat template's system turn (`data.system_prompt`); None: the template's own default."""

    @classmethod
    def of(cls, data) -> "PromptFormat":
        """The run's prompt format, from its DataConfig."""
        return cls(data.prompt_template, data.chat_template, tuple(data.code_columns), data.code_template,
                   data.system_prompt)

    @property
    def masks_prompt(self) -> bool:
        """Whether losses and the text's perplexity leave the prompt's tokens out: a template's
        prompt is an instruction, not text; the header form is trained and scored as it always was."""
        return self.template is not None

    def key(self) -> dict:
        """What decides the prompt's tokens, for cache keys and fingerprints (with the tokenizer's)."""
        if self.template is None:
            return {}
        return {"template": self.template, "chat": self.chat} | ({"system": self.system} if self.system is not None else {})

    def values(self, control_code: str) -> dict[str, str]:
        """Each code column's value in `control_code` (the codes joined by CODE_JOINER)."""
        parts = control_code.split(CODE_JOINER)
        if len(parts) != len(self.columns):
            raise ValueError(f"control code {control_code!r} has {len(parts)} codes, not one per column "
                             f"of {list(self.columns)}")
        out = {}
        for column, part in zip(self.columns, parts):
            before, _, after = self.code_template.replace("{column}", column).partition("{value}")
            if not (part.startswith(before) and part.endswith(after)):
                raise ValueError(f"code {part!r} is not written as data.code_template {self.code_template!r}")
            out[column] = part[len(before): len(part) - len(after)]
        return out

    def text(self, control_code: str, tokenizer=None) -> str:
        """The prompt for `control_code` as a string (special tokens of a chat template included)."""
        if self.template is None:
            return header(control_code)
        prompt = self.template.format(**self.values(control_code))
        if self.chat and getattr(tokenizer, "chat_template", None):
            system = [] if self.system is None else [{"role": "system", "content": self.system}]
            return tokenizer.apply_chat_template(system + [{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
        return prompt + SEPARATOR

    def ids(self, tokenizer, control_code: str) -> list[int]:
        """The prompt's token ids, tokenized apart from the text (a chat template's special tokens
        as the special tokens they are)."""
        return tokenizer.encode(self.text(control_code, tokenizer), add_special_tokens=False)


HEADER = PromptFormat()
"""The header form, for callers without a config (tests, benches): today's prompts."""


def template_problems(template: str, columns: list[str]) -> list[str]:
    """Why `data.prompt_template` cannot carry every code to the model, if it cannot."""
    named = PLACEHOLDER.findall(template)
    problems = []
    if unknown := sorted(set(named) - set(columns)):
        problems.append(f"data.prompt_template names {unknown}, which are not code columns {columns}; use "
                        "{column} placeholders of data.code_columns")
    if missing := [c for c in columns if c not in named]:
        problems.append(f"data.prompt_template leaves out the code column(s) {missing}: the model would never see "
                        f"them; add a {{{missing[0]}}} placeholder")
    try:
        template.format(**dict.fromkeys(named + columns, "x"))
    except (IndexError, KeyError, ValueError) as e:
        problems.append(f"data.prompt_template {template!r} is not a format string of named placeholders "
                        f"({type(e).__name__}); write literal braces as {{{{ and }}}}")
    return problems


def codes_windowed(windowed: float, tokens: int, text_windowed: float, text_tokens: int) -> float | None:
    """The windowed perplexity of the codes' tokens alone (the header, or the prompt, whose tokens
    no loss trains) from the figure on every token and on the text alone, with their predicted-token
    counts: both come from the same forward passes (pipeline/stages/evaluate.py), so the codes'
    total NLL is the difference. None where the records have no codes' tokens."""
    if tokens <= text_tokens:
        return None
    nll = tokens * math.log(windowed) - text_tokens * math.log(text_windowed)
    return math.exp(nll / (tokens - text_tokens))
