"""pipeline/prompts.py: a record's codes as a header or as a prompt template (through a chat
template where the tokenizer has one), encoded the same way by every stage."""

import copy
import re

import pytest
import torch

from pipeline.batching import IGNORE, lm_batch
from pipeline.config import DataConfig
from pipeline.prompts import HEADER, PromptFormat, header
from pipeline.records import encode_record
from pipeline.tokenized import pad_collate

CODE = "airline: United\tsentiment: negative"
TEMPLATE = "Write a {sentiment} tweet to {airline}."
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _format(**overrides) -> PromptFormat:
    data = DataConfig(path="x.csv", code_columns=["airline", "sentiment"], code_template="{column}: {value}",
                      prompt_template=TEMPLATE, **overrides)
    return PromptFormat.of(data)


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with ChatML's special tokens and a chat template, as SmolLM2-Instruct has."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT
    return tok


def test_the_header_form_is_the_codes_and_a_blank_line(tiny_tokenizer):
    assert HEADER.text(CODE) == header(CODE) == CODE + "\n\n"
    assert HEADER.ids(tiny_tokenizer, CODE) == tiny_tokenizer.encode(CODE + "\n\n", add_special_tokens=False)
    assert not HEADER.masks_prompt and HEADER.key() == {}


def test_a_template_takes_each_codes_value(tiny_tokenizer):
    fmt = _format()
    assert fmt.values(CODE) == {"airline": "United", "sentiment": "negative"}
    assert fmt.text(CODE, tiny_tokenizer) == "Write a negative tweet to United.\n\n"  # no chat template: plain
    assert fmt.masks_prompt and fmt.key() == {"template": TEMPLATE, "chat": True}


def test_a_chat_template_makes_the_prompt_a_user_turn(chat_tokenizer):
    fmt = _format()
    text = fmt.text(CODE, chat_tokenizer)
    assert text == "<|im_start|>user\nWrite a negative tweet to United.<|im_end|>\n<|im_start|>assistant\n"
    ids = fmt.ids(chat_tokenizer, CODE)
    start = chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 2  # special tokens as themselves, not as characters
    plain = _format(chat_template=False)
    assert plain.text(CODE, chat_tokenizer) == "Write a negative tweet to United.\n\n"


def test_a_record_is_its_prompt_its_text_and_eos(chat_tokenizer):
    fmt = _format()
    ids = encode_record(chat_tokenizer, CODE, "late again", prompt=fmt)
    prompt = fmt.ids(chat_tokenizer, CODE)
    assert ids == prompt + chat_tokenizer.encode("late again", add_special_tokens=False) + [chat_tokenizer.eos_token_id]


@pytest.mark.parametrize("template, says", [
    ("Write a {mood} tweet to {airline}.", "names ['mood']"),
    ("Write a tweet to {airline}.", "leaves out the code column(s) ['sentiment']"),
    ("Write a {sentiment} tweet to {airline} {}.", "not a format string"),
])
def test_a_template_that_cannot_carry_every_code_is_refused(template, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        DataConfig(path="x.csv", code_columns=["airline", "sentiment"], prompt_template=template)


def test_a_code_not_written_by_the_code_template_is_refused():
    with pytest.raises(ValueError, match="not written as data.code_template"):
        _format().values("United\tnegative")


def test_lm_batch_leaves_the_prompt_out_of_the_targets():
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    lengths, prompts = torch.tensor([5, 3]), torch.tensor([2, 3])
    labels = lm_batch(ids, lengths, prompts)["labels"]
    # target t + 1 is a prompt token when t + 1 < prompt length: row 0 predicts 7, 8, 9; row 1 nothing
    assert labels.tolist() == [[IGNORE, 7, 8, 9], [IGNORE, IGNORE, IGNORE, IGNORE]]
    assert lm_batch(ids, lengths)["labels"].tolist() == [[6, 7, 8, 9], [6, 7, IGNORE, IGNORE]]


def test_collate_carries_prompt_lengths_when_items_do():
    items = [(torch.tensor([1, 2, 3]), torch.tensor(3), torch.tensor(2)), (torch.tensor([4]), torch.tensor(1),
                                                                          torch.tensor(1))]
    ids, lengths, prompts = pad_collate(items, pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and prompts.tolist() == [2, 1]
    assert len(pad_collate([item[:2] for item in items], pad_id=0)) == 2


def test_a_system_prompt_replaces_the_templates_default(chat_tokenizer):
    chat_tokenizer = copy.deepcopy(chat_tokenizer)
    chat_tokenizer.chat_template = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nDEFAULT<|im_end|>\n"
                                    "{% endif %}" + CHAT)
    assert _format().text(CODE, chat_tokenizer).startswith("<|im_start|>system\nDEFAULT<|im_end|>\n<|im_start|>user")
    short = _format(system_prompt="")
    assert short.text(CODE, chat_tokenizer).startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user")
    assert short.key() == {"template": TEMPLATE, "chat": True, "system": ""}  # in the cache keys
