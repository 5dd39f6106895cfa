"""Run configuration: one pydantic model per stage inside one `PipelineConfig`.

Load a YAML file with dotted overrides, the way `tune run cfg key=value` does:

    cfg = load_config("configs/demo.yaml", ["teacher.target_epsilon=4", "seed=1"])

Unknown keys and wrong types are errors. Every problem in a file is reported in
one `ConfigError` whose lines each name the field, the value and the fix.
Relative paths are taken from the current working directory.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from pipeline.methods import DISTIL, METHOD_NAMES, method_spec
from pipeline.prompts import template_problems

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message lists every problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    """Stage 0: the private dataset, how records are built from it and split."""

    path: Path = Field(description="Private training data: a .csv, .jsonl or .parquet file.")
    test_path: Path | None = Field(
        None, description="Held-out private test data (same columns). None: split it off `path`."
    )
    text_column: str | list[str] = Field(
        "text",
        description="Column holding the record's text, or a list of columns whose texts are joined "
        "with `text_separator`, e.g. [title, description]; an empty or missing part is left out.",
    )
    text_separator: str = Field("\n", description="What joins the texts of several `text_column`s.")
    code_columns: list[str] = Field(
        default_factory=lambda: ["label1", "label2"],
        min_length=1,
        description="Categorical columns that become the control codes, in prompt order.",
    )
    code_template: str = Field(
        "{value}",
        description="How one control code is written; may use {column} and {value}, "
        "e.g. '{column}: {value}'.",
    )
    code_values: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="Names for the raw values of code columns, per column, e.g. {label: {'1': World, "
        "'2': Sports}}: the control codes (and control_codes.domain) use the names. A value its "
        "column's mapping lacks stops the data stage, naming row and column, unless "
        "`unmapped_code_values` is 'keep'. Columns not listed keep their values.",
    )
    prompt_template: str | None = Field(
        None,
        description="A natural-language prompt in place of the control-code header, with one {column} "
        "placeholder per code column, e.g. 'Write a {sentiment} tweet to the airline {airline}.'; each code's "
        "value (its code_values name) fills it. The same prompt prefixes a record in DP training and prompts "
        "generation, and its tokens are left out of every loss and of the text's perplexity. None: the "
        "header (the codes joined, then a blank line), for models built from scratch (pipeline/prompts.py).",
    )
    chat_template: bool = Field(
        True,
        description="With prompt_template: send the prompt as a user turn through the tokenizer's chat "
        "template, the assistant's turn opened after it, so that an instruction-tuned model reads it as "
        "an instruction; a tokenizer without one gets the prompt and a blank line.",
    )
    system_prompt: str | None = Field(
        None,
        description="With prompt_template and a chat template: the system turn before the prompt, e.g. "
        "'You write short airline tweets.'; '' an empty one. None: the chat template's default (SmolLM2's "
        "adds a 20-token one, which a short record pays for in every step).",
    )
    unmapped_code_values: Literal["error", "keep"] = Field(
        "error",
        description="A value missing from its column's `code_values`: 'error' (a typo in the mapping "
        "would otherwise mix raw values and names in the codes) or 'keep' it unchanged.",
    )
    max_records: int | None = Field(
        None,
        gt=0,
        description="Read only the first N rows of `path` (None: all). The validation split (and the "
        "test split when `test_path` is None) is taken from these rows, so fewer than N records train.",
    )
    max_test_records: int | None = Field(
        None, gt=0, description="Read only the first N rows of `test_path` (None: all)."
    )
    validation_fraction: float = Field(
        0.05, ge=0.0, lt=0.5, description="Share of the training file held out for validation."
    )
    test_fraction: float = Field(
        0.1, gt=0.0, lt=0.5, description="Share split off as test when `test_path` is None."
    )
    test_split: Literal["fixed", "keyed"] = Field(
        "fixed",
        description="Which units are split off as test when `test_path` is None (no effect otherwise). "
        "'fixed': those of lowest hash under a public salt (of the user, or of the record's codes "
        "and text), the same in every run, run root and checkout with the same file and data "
        "settings, so every row of a results table is scored on the same records (anyone holding "
        "the file can tell which are test). 'keyed': drawn with the run root's secret split key "
        "like validation, so that test membership stays secret too, but runs under different run "
        "roots score different test records.",
    )
    user_column: str | None = Field(
        None,
        description="Column naming each record's author. Set: user-level DP (all of a user's "
        "records count as one unit) and splits by user. None: record-level DP.",
    )
    drop_empty: bool = Field(
        False,
        description="Drop records whose text or codes are empty (counted in the data manifest) "
        "instead of stopping with an error.",
    )
    keep_private_copies: bool = Field(
        False,
        description="Keep the run's private splits (data/train|validation|test.parquet) and their "
        "token ids (data/tokenized/) after evaluation. False: they are deleted once evaluation is done and only their sha256 stay "
        "in the data manifest; a later run rewrites identical files (same data under the same run root), so the "
        "stages after it stay cached. Not part of any cache key.",
    )

    @property
    def text_columns(self) -> list[str]:
        """`text_column` as a list: the columns a record's text is joined from."""
        return [self.text_column] if isinstance(self.text_column, str) else list(self.text_column)

    @field_validator("code_values", mode="before")
    @classmethod
    def _numbers_as_strings(cls, v):
        """YAML reads `{label: {1: World}}` with a number for 1; the data stage compares each value
        as the string it reads (CSV "1", a Parquet 1 cast to "1")."""
        def s(x):
            return str(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x

        if isinstance(v, dict):
            return {c: {s(k): s(n) for k, n in m.items()} if isinstance(m, dict) else m for c, m in v.items()}
        return v

    @model_validator(mode="after")
    def _template_names_value(self) -> "DataConfig":
        problems = []
        if "{value}" not in self.code_template:
            problems.append(
                f"code_template {self.code_template!r} must contain '{{value}}', "
                "e.g. '{value}' or '{column}: {value}'"
            )
        texts = self.text_columns
        if not texts or any(not c for c in texts) or len(set(texts)) != len(texts):
            problems.append(f"text_column {self.text_column!r} must name one column or a list of distinct columns")
        if unknown := [c for c in self.code_values if c not in self.code_columns]:
            problems.append(f"code_values names {unknown}, which are not code columns; "
                            f"map values of {self.code_columns} only")
        if self.prompt_template is not None:
            problems += template_problems(self.prompt_template, self.code_columns)
        for c, mapping in self.code_values.items():
            bad = [name for name in mapping.values() if not name.strip() or any(ch in name for ch in "\t\n\r")]
            if bad:
                problems.append(f"code_values[{c!r}] has names {bad} that are empty or hold a tab or newline; "
                                "a control code is one line")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class CodesConfig(_Section):
    """How the control-code distribution that prompts generation is released.

    'gaussian' and 'geometric' add noise to the histogram over the declared `domain`, with
    their own ε, composed with the teacher's in the ledger's total. 'exact' uses the true
    counts of the private training split: NOT differentially private (the ledger says so),
    so it is never a default, only an explicit choice. Left unset, the mechanism is
    'gaussian' when `domain` is declared; without a domain the run asks for one of the two.
    """

    mechanism: Literal["exact", "gaussian", "geometric"] | None = Field(
        None,
        description="None: 'gaussian' when `domain` is declared, else a config error asking to declare "
        "it or to opt in to 'exact' (the true counts, NOT private).",
    )
    epsilon: float = Field(0.5, gt=0, description="ε of the histogram release (not 'exact').")
    domain: dict[str, list[str]] | None = Field(
        None,
        description="Every possible value of each code column, e.g. {label2: ['Review Stars: 1.0', "
        "...]}: public knowledge, required by the DP mechanisms (taking it from the private data "
        "would reveal which values occur).",
    )

    @model_validator(mode="after")
    def _dp_when_the_domain_is_known(self) -> "CodesConfig":
        if self.mechanism is None and self.domain is not None:
            self.mechanism = "gaussian"
        return self


class TinyModelSpec(_Section):
    """Shape and pretraining budget of one offline GPT-2-style base model."""

    n_layer: int = Field(2, ge=1, le=48)
    n_embd: int = Field(128, ge=8)
    n_head: int = Field(4, ge=1)
    steps: int = Field(300, ge=0, description="Pretraining steps on the public corpus.")
    batch_size: int = Field(16, ge=1)
    learning_rate: float = Field(3e-3, gt=0)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "TinyModelSpec":
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}; "
                "pick n_head among the divisors of n_embd"
            )
        return self


DP_TOKENIZER_FIELDS = ("tokenizer", "tokenizer_epsilon", "tokenizer_max_words")


class BaseModelsConfig(_Section):
    """The offline base models that `builtin:teacher` and `builtin:student` name.

    Without `corpus`, the pair shipped with the package (pipeline/models/builtin/, pretrained on
    public-domain novels by `dpdistill build-base --config configs/builtin.yaml`). With
    `corpus`, a pair of the shapes below built from that *public* text and cached. The
    tokenizer is trained on the public corpus only: a tokenizer trained on the private data
    would leak its vocabulary (Ponomareva et al.).
    """

    corpus: Path | None = Field(
        None,
        description="Public plain-text file, or directory of *.txt documents, to build the pair "
        "from; none: use the shipped pair.",
    )
    validation_documents: int = Field(
        3, ge=0, description="Documents of a corpus directory held out as the public validation split."
    )
    cache_dir: Path = Field(
        Path(".cache/base_models"), description="Built models are cached here by config hash."
    )
    vocab_size: int = Field(8192, ge=260, le=65536, description="Byte-level BPE vocabulary size.")
    context_length: int = Field(128, ge=16, le=4096, description="n_positions of the models.")
    max_corpus_chars: int | None = Field(
        None, gt=0, description="Use only the first N characters of the training text."
    )
    tokenizer: Literal["public", "dp"] = Field(
        "public",
        description="Where the byte-level BPE vocabulary is learned: 'public', from the public corpus; "
        "'dp', from a Gaussian-noised, thresholded histogram of the words of the private training split "
        "(Ponomareva et al. 2022, Algorithm 1), a DP release in the ledger and the budget. 'dp' needs "
        "base_models.corpus (the pair is then pretrained on the public corpus with that vocabulary).",
    )
    tokenizer_epsilon: float = Field(
        0.5, gt=0, description="tokenizer: dp: ε of the word histogram's Gaussian noise, at the teacher's δ.")
    tokenizer_max_words: int = Field(
        64, ge=1, le=100_000,
        description="tokenizer: dp: distinct words counted per privacy unit (the first ones it uses): the "
        "histogram's L2 sensitivity is √k; more counts more words per unit, with more noise per word.",
    )
    teacher: TinyModelSpec = Field(
        default_factory=lambda: TinyModelSpec(n_layer=4, n_embd=256, n_head=8, steps=1500, batch_size=32)
    )
    student: TinyModelSpec = Field(
        default_factory=lambda: TinyModelSpec(n_layer=2, n_embd=128, n_head=4, steps=800, batch_size=32)
    )

    def cache_fields(self) -> dict:
        """The fields a build depends on, as JSON: without the DP tokenizer's settings when the
        tokenizer is public (so that caches made before they existed stay valid) and the cache folder."""
        unused = {"cache_dir"} | (set(DP_TOKENIZER_FIELDS) if self.tokenizer == "public" else set())
        return self.model_dump(mode="json", exclude=unused)

    @model_validator(mode="after")
    def _shapes_need_a_corpus(self) -> "BaseModelsConfig":
        # Defaults are the shipped pair's recipe, so a dumped config (defaults written out) loads back.
        shaped = [name for name in ("vocab_size", "context_length", "max_corpus_chars", "teacher", "student")
                  if getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)]
        if self.corpus is None and self.tokenizer == "dp":
            raise ValueError(
                "base_models.tokenizer=dp learns a new vocabulary, so the pair must be built from scratch, but "
                "base_models.corpus is not set (the shipped pair has its own public tokenizer): set "
                "base_models.corpus to a public text file or directory, or set base_models.tokenizer=public"
            )
        if self.corpus is None and shaped:
            raise ValueError(
                f"base_models.{shaped[0]} differs from the shipped builtin pair's but base_models.corpus "
                "is not set: the shipped pair has fixed shapes; set base_models.corpus to a public text "
                "file or directory to build a pair of your own, or remove the shape fields"
            )
        return self


class TeacherConfig(_Section):
    """Stage 1: DP-SGD fine-tuning of the teacher on the private records (Opacus)."""

    model: str = Field(
        "builtin:teacher",
        description="Base checkpoint: 'builtin:teacher' (built offline), 'cache:NAME' (a real model "
        "put in the local model cache by `dpdistill models fetch NAME`, e.g. 'cache:smollm2-135m'), a "
        "local directory or a hub name such as 'gpt2-large' when a hub cache is available.",
    )
    target_epsilon: float = Field(2.0, gt=0, description="Privacy budget ε of the teacher.")
    target_delta: float | Literal["1/N", "1/(10N)"] = Field(
        "1/(10N)",
        description="δ, or a rule for it over the N training records (or users): '1/(10N)' (the "
        "default) or '1/N' (the paper's setting; weak: a mechanism that publishes each record with "
        "probability δ satisfies it and releases one record in expectation).",
    )

    @model_validator(mode="after")
    def _delta_is_a_probability(self) -> "TeacherConfig":
        if isinstance(self.target_delta, float) and not 0 < self.target_delta < 1:
            raise ValueError(f"target_delta={self.target_delta} must be in (0, 1), or '1/(10N)' or '1/N'")
        return self
    max_grad_norm: float = Field(1.0, gt=0, description="Per-example clipping norm C.")
    epochs: int = Field(
        3, ge=1, description="Passes over the data (in expectation, Poisson). This section's training settings "
        "also train the student under distill.method=dp_sgd or dpkd.",
    )
    batch_size: int = Field(
        256, ge=1, description="Expected logical batch size; sampling rate q = batch_size / N."
    )
    physical_batch_size: int = Field(
        16, ge=1, description="Examples per forward/backward pass (BatchMemoryManager)."
    )
    learning_rate: float = Field(1e-4, gt=0, description="Also the DP-SGD student's (distill.method=dp_sgd, dpkd).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="The learning rate over the logical steps: 'constant'; 'linear' or 'cosine': a linear "
        "warm-up over `lr_warmup_fraction` of the steps, then a decay to 0. More steps at the same ε carry "
        "more noise each; a decaying rate averages it out at the end (issue 59 item 3). A public setting: it "
        "costs no privacy.",
    )
    lr_warmup_fraction: float = Field(
        0.05, ge=0, lt=1, description="With lr_schedule linear or cosine: the share of steps of the warm-up.")
    weight_decay: float = Field(0.0, ge=0)
    max_length: int = Field(128, ge=8, description="Tokens per training record (truncated).")
    accountant: Literal["prv", "rdp", "gdp"] = Field("prv", description="Opacus accountant.")
    mode: Literal["full", "bitfit", "lora"] = Field(
        "full",
        description="What trains: 'full' every weight; 'bitfit' only the bias terms (DP-BiTFiT, "
        "Bu et al.); 'lora' low-rank adapters through peft (merged into the saved checkpoint).",
    )
    grad_sample_mode: Literal["bk", "ghost", "hooks"] = Field(
        "bk",
        description="'bk': book-keeping clipping (pipeline/privacy/bk.py), the clipped gradient in one backward "
        "pass, the fastest (docs/teacher_modes.md); 'ghost': Opacus ghost clipping (two backward passes); "
        "'hooks': Opacus per-sample gradients (the reference). All three give the same update.",
    )
    untie_lm_head: bool = Field(
        True,
        description="Give lm_head its own weight before DP-SGD where the model ties it to the input embedding "
        "(GPT-2, Llama 3.2, Qwen2.5, SmolLM2, Gemma): vocabulary × width more trainable parameters, each "
        "noised (28.3 M on SmolLM2-135M), and the saved model keeps its own head. false: keep the tie, one "
        "weight with two uses, which bk clipping clips by the norm of the two uses' summed gradient "
        "(pipeline/privacy/bk.py); needs grad_sample_mode=bk (ghost and hooks clip each use apart). mode=lora and "
        "bitfit keep the tie whatever this says: they train neither use.",
    )

    @property
    def unties_head(self) -> bool:
        """Whether DP-SGD gives lm_head its own weight: only where it trains it (mode=full). LoRA and
        BiTFiT freeze the head and the embedding, and a frozen weight is clipped nowhere, so the tie
        stays and the saved teacher is the base model's size."""
        return self.untie_lm_head and self.mode == "full"

    @model_validator(mode="after")
    def _a_kept_tie_needs_bk(self) -> "TeacherConfig":
        if not self.untie_lm_head and self.mode == "full" and self.grad_sample_mode != "bk":
            raise ValueError(f"teacher.untie_lm_head=false needs teacher.grad_sample_mode=bk (it is "
                             f"{self.grad_sample_mode!r}, which would clip the tied weight's two uses apart); "
                             "set teacher.grad_sample_mode=bk or teacher.untie_lm_head=true")
        return self

    lora_rank: int = Field(8, ge=1, description="LoRA rank r (mode=lora).")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scaling α (mode=lora).")
    lora_target_modules: list[str] | None = Field(
        None, description="Modules LoRA adapts (mode=lora), by name; None: every linear map of the decoder "
        "blocks (attention and MLP projections, not the output head), for any family."
    )
    checkpoint_every: int = Field(
        10, ge=1, description="Save a resumable checkpoint (with the accountant) every N steps."
    )
    secure_mode: bool = Field(
        False, description="Cryptographically secure noise (ChaCha20) for every DP noise source; turn on for "
        "production. On a CPU it costs about 44 ns a trainable parameter a DP step at 2 threads (~7 s at 163 M "
        "parameters, against ~0.5 s for the default's mt19937; docs/benchmarks.md)."
    )
    log_every: int = Field(
        5, ge=1, description="Record ε (and the validation loss, see `monitor`) every N logical steps in "
        "training_log.json (never the loss of a private batch); the log shows them only every 20 steps "
        "and at the end, since a time is published with each line (issue 21). With monitor=dp, more "
        "frequent releases mean more noise on each at the same monitor_epsilon."
    )
    monitor: Literal["none", "dp", "public"] = Field(
        "none",
        description="What the validation loss published while training is computed from (issue 21: "
        "a loss on private validation records, published exactly, confirmed a candidate record). "
        "'none' (the default): no validation loss is computed or published; ε and steps only. "
        "'dp': the mean clipped per-record loss on the validation split plus Gaussian noise, an "
        "accounted release (ledger entry '<stage>-validation', composed into the total). "
        "'public': the loss on `monitor_path`, records you declare public, published exactly.",
    )
    monitor_epsilon: float = Field(
        0.5, gt=0, description="monitor=dp: ε of all the validation-loss releases together, at the "
        "run's δ; composed with the DP-SGD stage's ε in the run's total.",
    )
    monitor_records: int | None = Field(
        None, ge=1, description="How many validation (monitor=dp) or public (monitor=public) records "
        "the loss is the mean over, the first ones; None: all of them. Fewer: cheaper, noisier (dp).",
    )
    monitor_clip: float = Field(
        10.0, gt=0, description="monitor=dp: each record's mean per-token loss is clipped to [0, this] "
        "(nats), so one record moves the mean by at most monitor_clip / n; the noise scales with it.",
    )
    monitor_path: Path | None = Field(
        None, description="monitor=public: a file of records you declare public (a .csv, .jsonl or "
        ".parquet with the columns of data.path); its loss is published without noise.",
    )

    @model_validator(mode="after")
    def _monitor_is_consistent(self) -> "TeacherConfig":
        if self.monitor == "public" and self.monitor_path is None:
            raise ValueError("teacher.monitor=public needs teacher.monitor_path (a file of public records); "
                             "or set teacher.monitor=dp (noisy) or none")
        if self.monitor != "public" and self.monitor_path is not None:
            raise ValueError(f"teacher.monitor_path is set but teacher.monitor={self.monitor!r}: set "
                             "teacher.monitor=public to use it, or remove teacher.monitor_path")
        return self

    processes: int = Field(
        1,
        ge=1,
        description="Data-parallel processes (Opacus DPDDP). >1: the stage runs under torchrun, each "
        "process Poisson-samples its share of the records; the global expected batch stays "
        "batch_size, so q, σ and ε are those of one process.",
    )
    ddp_backend: Literal["gloo", "nccl"] = Field(
        "gloo",
        description="torch.distributed backend when processes > 1: 'gloo' on CPU; 'nccl' puts "
        "each process on its own CUDA device (one GPU per process).",
    )
    nnodes: int = Field(
        1, ge=1,
        description="Machines the data-parallel teacher spans, `processes` ranks on each. >1: the node "
        "running the flow (node_rank 0) starts torchrun with a c10d rendezvous at rdzv_endpoint and every "
        "other node runs `dpdistill join-teacher` with this config and its node_rank; the run directory "
        "and the data must be on storage all nodes mount at the same path. q, σ and ε stay those of one process.",
    )
    node_rank: int = Field(
        0, ge=0, description="This machine's place among nnodes: 0 runs the flow, 1..nnodes-1 join it."
    )
    rdzv_endpoint: str | None = Field(
        None, description="host:port on node 0 where the nodes meet (torchrun's c10d rendezvous store; "
        "unauthenticated: keep it on a private network). Needed when nnodes > 1.",
    )
    rdzv_timeout: int = Field(900, ge=1, description="Seconds the nodes wait for one another at the rendezvous.")

    @model_validator(mode="after")
    def _nodes_are_consistent(self) -> "TeacherConfig":
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"teacher.nnodes={self.nnodes} needs teacher.rdzv_endpoint (host:port on node 0, "
                             "reachable from every node)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"teacher.node_rank={self.node_rank} must be below teacher.nnodes={self.nnodes}")
        return self


# Teacher settings added after stage caches and checkpoints existed: while at these defaults they
# stay out of the teacher's cache key and a checkpoint's fingerprint, so what was made before them
# (a study's shared DPKD teacher, an interrupted run's checkpoint) is still found.
LATER_DEFAULTS = {"untie_lm_head": True, "lr_schedule": "constant", "lr_warmup_fraction": 0.05}


def at_later_defaults(cfg: TeacherConfig) -> set[str]:
    """The LATER_DEFAULTS fields `cfg` leaves at their default: to leave out of keys."""
    return {name for name, value in LATER_DEFAULTS.items() if getattr(cfg, name) == value}


# Where a data-parallel teacher's ranks run, never what it learns: in neither the stage's cache key
# nor a checkpoint's fingerprint (which holds the world size: resuming needs the same rank count).
NODE_FIELDS = frozenset({"nnodes", "node_rank", "rdzv_endpoint", "rdzv_timeout"})


class GenerateConfig(_Section):
    """Stage 2: the DP teacher writes synthetic records (post-processing, no privacy cost)."""

    num_samples: int = Field(2000, ge=1, description="Synthetic samples to write in all.")
    samples_per_prompt: int = Field(
        1, ge=1, description="Samples generated from each drawn control-code prompt."
    )
    batch_size: int = Field(
        256, ge=1, description="Rows decoded side by side (the fast engine refills each as its sample ends). "
        "On 2 CPU threads the demo teacher decoded 1.45x the tokens/s at 256 rows as at 64 (larger matmuls); "
        "the key/value cache grows with it: rows x layers x 2 x max_length x width values.")
    top_k: int = Field(50, ge=0, description="0 disables top-k filtering.")
    top_p: float = Field(0.9, gt=0, le=1.0)
    temperature: float = Field(1.0, gt=0)
    no_repeat_ngram_size: int = Field(0, ge=0, description="Forbid repeating n-grams of this size (0: off).")
    max_length: int = Field(128, ge=8, description="Tokens per sample including the prompt.")
    max_new_tokens: int | None = Field(
        None, ge=1, description="Cap on generated tokens per sample (besides max_length)."
    )
    shard_size: int = Field(
        10_000, ge=1, description="Samples per Parquet shard: memory bound and unit of resumption."
    )
    validation_fraction: float = Field(
        0.01, ge=0, lt=0.5, description="Share of samples marked split='validation' for distillation, "
        "rounded up per shard: a shard of 2 or more samples has at least one (0: none).",
    )
    workers: int = Field(
        1,
        ge=1,
        description="Local worker processes generating shards in parallel (a Dask cluster under "
        "Prefect); 1 generates in-process. The shards are the same for any value. Ignored with "
        "`dask_address`, where the cluster's workers do the work.",
    )
    dask_address: str | None = Field(
        None,
        min_length=1,
        description="A running Dask scheduler (e.g. 'tcp://10.0.0.5:8786') to send the shards to, "
        "instead of local processes; unset: $DASK_SCHEDULER_ADDRESS if set, else `workers`. Every "
        "worker loads the teacher and writes shards by path: the run directory must be on storage "
        "shared by all nodes, mounted at the same path (checked before any shard is generated; "
        "docs/operations.md, 'Running generation on a Dask cluster'). Like `workers`, it changes "
        "where shards are computed, never what they hold.",
    )
    engine: Literal["fast", "hf"] = Field(
        "fast",
        description="'fast': our decode loop around any causal LM's own forward (KV cache allocated once, a "
        "slot refilled as its sample ends, top-k/top-p on the k largest logits; pipeline/models/decoding.py). 'hf': "
        "transformers' generate, the reference; the same sampling distribution, other samples for a seed.",
    )


# The DistillConfig fields a selection candidate may set (the rest is shared by all candidates).
CANDIDATE_FIELDS = ("alpha", "temperature", "beta", "kl_skip_tokens", "epochs", "learning_rate",
                    "num_synthetic", "batch_size", "weight_decay", "warmup_fraction")


def candidate_name(settings: dict[str, Any]) -> str:
    """A candidate's name from its settings, in CANDIDATE_FIELDS order: 'alpha=1.0,beta=1.0'."""
    return ",".join(f"{k}={settings[k]}" for k in CANDIDATE_FIELDS if k in settings) or "default"


class DistillConfig(_Section):
    """Stage 3: the student learns from the synthetic data only (no DP needed)."""

    method: Literal[METHOD_NAMES] = Field(
        DISTIL.name,
        description="'distil': ours, KD from the DP teacher on synthetic data; 'dp_syn': synthetic "
        "data only (α=0); 'dp_sgd': the student itself DP fine-tuned on the private data at the "
        "teacher's ε; 'dpkd': the teacher, then the student DP fine-tuned with the KD loss on private "
        "data, at equal shares of ε that the accountant composes to the teacher's ε. dp_sgd and dpkd "
        "train the student with the `teacher` section's "
        "settings (epochs, batch_size, learning_rate, max_grad_norm, max_length, ...), not this "
        "section's epochs, batch_size or learning_rate: tune them there (a warning names any set here). "
        "'public_only': the ε = 0 control, ours' distillation from text the base teacher (teacher.model, "
        "not fine-tuned) writes, prompted uniformly over control_codes.domain: no private record read but "
        "the test split's. The base student ('zero-shot') is always evaluated.",
    )
    student_model: str = Field(
        "builtin:student",
        description="'builtin:student', 'cache:NAME' (e.g. 'cache:smollm2-135m-4l', built by `dpdistill "
        "models student smollm2-135m --layers 4`), a local directory or a hub name such as 'distilgpt2'.",
    )
    alpha: float = Field(
        1.0, ge=0, le=1,
        description="Weight of the KL term; 0 = plain CE. 1 (the default for 'distil'): the KL alone, "
        "which the selection rule kept over the paper's 0.4 in every run measured (docs/pipeline.md, "
        "'Choosing α'). Unset with method=dpkd: 0.4, the best of {0.4, 1} for DPKD in every equal-effort "
        "study (docs/baselines.md). Each of `candidates` may set its own.",
    )
    temperature: float = Field(1.0, gt=0, description="Softmax temperature T of the KL term.")
    beta: float = Field(
        0.0,
        ge=0,
        description="Weight of the last-hidden-state MSE; a learned linear projection maps the "
        "student's hidden size to the teacher's when they differ.",
    )
    kl_skip_tokens: int | None = Field(
        0,
        ge=0,
        description="Leading tokens the KL skips (the paper: 5, its control codes); None skips each "
        "sample's whole control-code prompt. 0 (the default): the KL covers every token, the codes "
        "included, which the test perplexity counts too; with alpha=1 the KL is the student's only "
        "signal for them.",
    )
    epochs: int = Field(
        2, ge=1, description="Passes of the distillation over the synthetic data. Not used by method=dp_sgd "
        "or dpkd, whose student trains with DP-SGD with teacher.epochs.",
    )
    batch_size: int = Field(
        16, ge=1, description="Distillation batch size. Not used by method=dp_sgd or dpkd (teacher.batch_size).",
    )
    learning_rate: float = Field(
        8e-5, gt=0, description="Distillation learning rate. Not used by method=dp_sgd or dpkd, whose "
        "student trains with DP-SGD with teacher.learning_rate.",
    )
    warmup_fraction: float = Field(
        0.05, ge=0, lt=1, description="Linear warm-up, then linear decay (the distillation; not dp_sgd or dpkd).",
    )
    weight_decay: float = Field(0.0, ge=0, description="The distillation's (dp_sgd and dpkd: teacher.weight_decay).")
    eval_every: int = Field(
        50, ge=1, description="Steps between evaluations on the synthetic validation split."
    )
    patience: int | None = Field(
        None, ge=1, description="Stop after this many evaluations without improvement (None: never)."
    )
    log_every: int = Field(20, ge=1)
    length_groups: int = Field(
        4, ge=1,
        description="The models run each batch in this many groups of samples of similar length, each "
        "padded to its own longest (1: the whole batch padded to its longest). The batch, its loss and "
        "its gradient stay the same; only padding is saved.",
    )
    teacher_top_k: int | None = Field(
        None,
        ge=1,
        description="None: teacher logits on the fly at every step. k: the teacher's top-k logits "
        "per token (and the logsumexp of all of them) are computed once, cached as Parquet next to the "
        "synthetic data and reused by every student; at T = 1 the KL compares the k tokens and the "
        "rest of the vocabulary as one bucket, at T ≠ 1 it renormalises over the k tokens (k = vocabulary "
        "size: exact). Twice as fast a step, but the student does not learn the shape of the teacher's "
        "tail, which cost test perplexity on the demo (experiments/teacher_cache_quality.py measures how much).",
    )
    keep_samples: Literal["all", "code_adherent"] = Field(
        "all",
        description="Which synthetic train samples the student learns from. 'all'; 'code_adherent': only those "
        "the teacher that wrote them recognises as written for their requested codes (on every code column "
        "with two or more declared values, the requested value gives the sample's text the highest "
        "likelihood; pipeline/stages/adherence.py): post-processing of the teacher and its text, no privacy "
        "cost. Needs control_codes.domain; costs one teacher forward pass per declared value per sample.",
    )
    num_synthetic: int | None = Field(
        None,
        ge=1,
        description="Train the student on only the first N synthetic train samples, in the shards' "
        "order (None: all): one generation serves several students, e.g. the paper's Figure 3 "
        "(perplexity against the number of synthetic samples). 'distil' and 'dp_syn' only; dp_sgd "
        "and dpkd train on the private data and ignore it.",
    )

    candidates: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Settings to train a student with, each overriding this section's fields "
        f"({', '.join(CANDIDATE_FIELDS)}), e.g. [{{alpha: 0.4}}, {{alpha: 1.0}}]; the student with the "
        "lowest `select_by` is kept. [] (the default) or one candidate: no selection, this section's "
        "settings (or the lone candidate's) train the student. The zero-cost rule (select_by=teacher_kl) "
        "kept alpha=1 in every run measured and cannot see a teacher that is wrong (docs/pipeline.md); "
        "select_by=private_validation can, at an accounted cost.",
    )
    select_by: Literal["teacher_kl", "untruncated_ce", "synthetic_validation_ce", "private_validation"] = Field(
        "teacher_kl",
        description="How candidates are compared, on `selection_samples` texts the DP teacher samples "
        "WITHOUT top-k/top-p truncation (its whole distribution, which the student should match): "
        "'teacher_kl' the mean per-token KL(teacher || student), 'untruncated_ce' the student's "
        "cross-entropy on them (the same ranking in expectation, noisier); "
        "'synthetic_validation_ce' the student's best CE on the truncated synthetic validation split "
        "(it rewards the truncated distribution the test text does not follow; kept for comparison). These cost no "
        "privacy. 'private_validation': each student's loss on the PRIVATE validation split, clipped and "
        "released with Gaussian noise at `selection_epsilon` (pipeline/privacy/private_selection.py), a "
        "DP release of its own in the ledger, composed into the run's total.",
    )
    selection_epsilon: float = Field(
        0.2, gt=0,
        description="select_by=private_validation: ε of the release of every candidate's noisy validation "
        "score together (at the run's δ), added to the run's total.",
    )
    selection_clip: float = Field(
        10.0, gt=0,
        description="select_by=private_validation: each privacy unit's mean per-token loss is clipped to "
        "[0, this] nats, so one unit moves a candidate's score by at most selection_clip / n; the noise "
        "scales with it.",
    )
    selection_split: Literal["train+validation", "validation"] = Field(
        "train+validation",
        description="select_by=private_validation: the private records that score the candidates. "
        "'train+validation': the validation units and the training units (about 20x the units at "
        "data.validation_fraction 0.05, so about 20x less noise on each score at the same ε; in the "
        "comparison planned for it, docs/baselines.md's third plan, its mean regret was below the validation "
        "split's, windowed and per record: docs/privacy.md). 'validation': the validation split alone.",
    )
    selection_records: int | None = Field(
        None, ge=1,
        description="select_by=private_validation: score the first this many units (None: all; more units, "
        "less noise on each score): the validation split's, then the training split's.",
    )
    selection_samples: int = Field(
        256, ge=8, description="Untruncated samples the DP teacher writes for the selection criterion."
    )
    keep_candidates: bool = Field(
        False,
        description="Keep every candidate's student (student/candidates/<name>/model) and evaluate each "
        "on the test split, for studying the criterion; False keeps the chosen one only.",
    )

    @field_validator("candidates")
    @classmethod
    def _candidates_name_fields(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        problems = []
        for i, c in enumerate(v):
            if not isinstance(c, dict) or not c:
                problems.append(f"candidates[{i}] = {c!r} is not a mapping of settings, e.g. {{alpha: 1.0}}")
            elif unknown := sorted(set(c) - set(CANDIDATE_FIELDS)):
                problems.append(f"candidates[{i}] sets {unknown}; a candidate may set {list(CANDIDATE_FIELDS)}")
        if len({candidate_name(c) for c in v if isinstance(c, dict)}) < len(v):
            problems.append("two candidates have the same settings; list each setting once")
        if problems:
            raise ValueError("; ".join(problems))
        return v

    _built: tuple[dict, list, list] | None = PrivateAttr(None)
    """(the section's other fields, its candidates, candidate_configs' answer) as last built."""

    def candidate_configs(self) -> list[tuple[str, "DistillConfig"]]:
        """(name, settings) of each candidate: this section with the candidate's fields, each
        validated as a whole section (a candidate alpha=2 is refused like distill.alpha=2).

        Built once per setting of the section (issue 61): validating the config builds them, and
        the plan and the distillation stage read that; a section changed since (an assignment,
        `model_copy(update=...)`, a candidate edited in place) builds them again."""
        base = self.model_dump(exclude={"candidates"})
        if self._built is None or self._built[:2] != (base, self.candidates):
            self._built = (base, copy.deepcopy(self.candidates), self._build_candidates(base))
        return list(self._built[2])

    def _build_candidates(self, base: dict) -> list[tuple[str, "DistillConfig"]]:
        out = []
        for i, c in enumerate(self.candidates):
            try:
                out.append((candidate_name(c), DistillConfig(**{**base, **c, "candidates": []})))
            except ValidationError as e:
                raise ConfigError(f"distill.candidates[{i}] = {c!r}:\n{_format_errors(e)}") from e
        return out

    @model_validator(mode="after")
    def _alpha_of_the_method(self) -> "DistillConfig":
        """α when unset follows the method, also when the method is assigned later: 0.4 for DPKD,
        1 otherwise (the field's description). Written past validate_assignment, which would call
        this again."""
        if "alpha" not in self.model_fields_set:
            self.__dict__["alpha"] = method_spec(self.method).default_alpha
        return self

    @model_validator(mode="after")
    def _top_k_without_hidden_mse(self) -> "DistillConfig":
        if self.teacher_top_k is not None and self.beta > 0:
            raise ValueError(
                f"distill.teacher_top_k={self.teacher_top_k} caches logits only, but distill.beta={self.beta} "
                "needs the teacher's hidden states at every step; set distill.beta=0 or distill.teacher_top_k=null"
            )
        return self

    @model_validator(mode="after")
    def _check_candidates(self) -> "DistillConfig":
        if self.candidates:  # each candidate's values, checked at load time (ConfigError: a ValueError)
            self.candidate_configs()
        spec = method_spec(self.method)
        if spec.dp_student:  # one DP-SGD student: the candidates are never trained
            if "candidates" in self.model_fields_set and self.candidates:
                log.warning(
                    "distill.candidates is set, but distill.method=%s trains one DP-SGD student and never reads "
                    "it%s; set distill.candidates=[]", self.method,
                    " (its KD loss takes distill.alpha and distill.temperature)" if spec.teacher_logits else "",
                )
            return self
        # ("candidates" set to [] is a candidate's own section, candidate_configs: not the user's)
        unchosen = len(self.candidates) == 1 or "candidates" not in self.model_fields_set
        if unchosen and "select_by" in self.model_fields_set and spec.distils:
            log.warning(
                "distill.select_by=%s set, but distill.candidates lists %s: nothing is chosen (and nothing "
                "released); list the settings to choose among, e.g. distill.candidates=[{alpha: 0.4}, {alpha: 1.0}]",
                self.select_by, "one setting" if self.candidates else "none")
        if not self.candidates and self.alpha == 1 and self.kl_skip_tokens != 0 and spec.distils:
            log.warning(
                "distill.alpha=1 with distill.kl_skip_tokens=%s: the tokens the KL skips (the control-code "
                "header) get no training signal, and the test perplexity counts them; set "
                "distill.kl_skip_tokens=0 or distill.alpha below 1", self.kl_skip_tokens)
        if len(self.candidates) > 1:
            shadowed = sorted({k for c in self.candidates for k in c} & self.model_fields_set)
            if shadowed:
                log.warning(
                    "distill.%s set, but distill.candidates sets %s too and each candidate's value is used; "
                    "set distill.candidates=[] to train with this section's settings alone",
                    ", distill.".join(shadowed), "it" if len(shadowed) == 1 else "them",
                )
        return self


class EvalConfig(_Section):
    """Stage 4: perplexity on the held-out private test split, and code adherence of the synthetic text."""

    window: int = Field(128, ge=8, description="Non-overlapping window length in tokens.")
    batch_size: int = Field(16, ge=1)
    adherence_samples: int = Field(
        500,
        ge=0,
        description="Synthetic training samples (the first ones, in shard order) on which the DP teacher, which "
        "wrote them, is asked which code each was prompted with (pipeline/stages/adherence.py: its own recognition, "
        "not whether the text carries the code for a reader); 0 disables it. Cost: about "
        "(sum over code columns of the number of declared values) teacher forward passes per sample.",
    )
    mauve_texts: int = Field(
        1000,
        ge=0,
        description="Synthetic and real test texts (as many of each) that MAUVE compares on the DP teacher's "
        "features (pipeline/stages/downstream.py); 0 disables it. About 10-30 s on 2 cores at 1,000.",
    )


class PrivacyConfig(_Section):
    """Limits on what the training records may spend over every run under `run_root`
    (pipeline/privacy/budget.py keeps that budget, keyed by the records themselves)."""

    max_epsilon: float | None = Field(
        None, gt=0,
        description="The most ε (add/remove, the unit of teacher.target_epsilon) that every DP release on the "
        "training records, or on records overlapping them, by any run under run_root, may spend composed "
        "together. A run that would pass it is refused before its first DP stage computes, and `dpdistill "
        "plan` says so. None: no limit (the total is still reported).",
    )


class PipelineConfig(_Section):
    """The whole run. `seed` is set at the start of every stage."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9._-]+$", description="Run name prefix.")
    seed: int = Field(0, ge=0)
    run_root: Path = Field(Path("runs"), description="Run directories are created in here.")
    progress_seconds: float = Field(
        30.0, gt=0, description="Most seconds between two progress lines (done/total, rate, ETA) of a "
        "long stage: teacher, generation, distillation, evaluation. The first step or batch is always "
        "logged, except a DP stage's: its lines come only every 20 steps and at the end (a step's "
        "duration is private). Not part of any stage's cache key.",
    )
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda|cuda:\d+)$",
        description="Where every stage computes: 'auto' (CUDA when present, else CPU), 'cpu', 'cuda' "
        "(cuda:0) or 'cuda:N'. A data-parallel teacher on nccl puts rank r on cuda:r. Not part of any "
        "cache key: it changes the rounding of a result, not what is computed.",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="'fp32', or 'bf16': training stages (DP-SGD teacher or student, distillation) under "
        "torch.autocast with fp32 master weights, inference stages (generation, logit cache, evaluation) "
        "with bf16 weights; losses, perplexities and ε in fp32. 'fp16' is refused: its loss scaling "
        "would scale the per-example gradients that DP clipping bounds. Part of the cache keys.",
    )
    threads: int | None = Field(
        None, ge=1,
        description="torch CPU threads per process (stages, generation workers, data-parallel ranks). "
        "None: $OMP_NUM_THREADS when set, else min(4, cores / processes). Not part of any cache key.",
    )
    data: DataConfig
    control_codes: CodesConfig = Field(default_factory=CodesConfig)
    base_models: BaseModelsConfig = Field(default_factory=BaseModelsConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    evaluate: EvalConfig = Field(default_factory=EvalConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "PipelineConfig":
        problems = []
        if self.teacher.physical_batch_size > self.teacher.batch_size:
            problems.append(
                f"teacher.physical_batch_size={self.teacher.physical_batch_size} exceeds "
                f"teacher.batch_size={self.teacher.batch_size}; lower it to at most the batch size"
            )
        if self.precision == "fp16":
            problems.append(
                "precision=fp16 is not supported: every method trains with DP-SGD, and fp16 needs loss "
                "scaling, which scales the per-example gradients that clipping bounds by max_grad_norm "
                "(the noise would no longer match the clipping); use precision=bf16 (CPU, or CUDA GPUs "
                "from Ampere on) or precision=fp32"
            )
        on_cuda, nccl = self.device.startswith("cuda"), self.teacher.ddp_backend == "nccl"
        if self.teacher.processes > 1 and self.device != "auto" and on_cuda != nccl:
            problems.append(
                f"teacher.ddp_backend={self.teacher.ddp_backend} with device={self.device}: gloo ranks run on the "
                "CPU and nccl ranks on one GPU each; set teacher.ddp_backend=nccl with a CUDA device, or "
                "teacher.ddp_backend=gloo with device=cpu (device=auto follows the backend)"
            )
        n_synthetic, n_generated = self.distill.num_synthetic, self.generate.num_samples
        spec = method_spec(self.distill.method)
        if n_synthetic is not None and n_synthetic > n_generated and spec.generates:
            # Caught here, before the teacher trains; the distillation stage checks the exact
            # count of train samples (fewer: validation split, dropped empty samples).
            problems.append(
                f"distill.num_synthetic={n_synthetic} asks for more synthetic samples than "
                f"generate.num_samples={n_generated} makes; lower distill.num_synthetic or raise "
                "generate.num_samples"
            )
        codes = self.control_codes
        if self.distill.keep_samples != "all" and (not spec.generates or codes.domain is None):
            problems.append(
                f"distill.keep_samples={self.distill.keep_samples} keeps synthetic samples by the declared code "
                "values: it needs a method that generates (distil, dp_syn, public_only) and control_codes.domain")
        if spec.generates and not spec.releases_codes:
            missing = [c for c in self.data.code_columns if c not in (codes.domain or {})]
            if missing:
                problems.append(
                    f"distill.method={spec.name} prompts the base teacher uniformly over control_codes.domain, "
                    f"which does not list the possible values of {missing}; declare them (public knowledge)")
            if self.distill.select_by == "private_validation" and len(self.distill.candidates) > 1:
                problems.append(
                    f"distill.method={spec.name} reads no private record, but distill.select_by=private_validation "
                    "chooses on private ones; set distill.select_by=teacher_kl (or another rule on public outputs)")
        elif codes.mechanism is None and spec.releases_codes:
            problems.append(
                "control_codes: the control-code distribution that prompts generation is released with "
                "DP by default, which needs control_codes.domain (the public list of possible values of "
                f"each of {self.data.code_columns}); declare it, or opt in to control_codes.mechanism=exact "
                "(the exact counts of the private training split: NOT differentially private)"
            )
        elif codes.mechanism not in (None, "exact"):
            missing = [c for c in self.data.code_columns if c not in (codes.domain or {})]
            if missing:
                problems.append(
                    f"control_codes.mechanism={codes.mechanism} needs control_codes.domain to list the "
                    f"possible values of {missing} (public knowledge, not read from the private data)"
                )
        for c, mapping in self.data.code_values.items():
            names = set(mapping.values())
            if self.data.unmapped_code_values == "error" and (raw := [v for v in (codes.domain or {}).get(c, [])
                                                                      if v not in names]):
                problems.append(
                    f"control_codes.domain[{c!r}] lists {raw}, which data.code_values[{c!r}] never produces: "
                    f"the domain holds the mapped names ({sorted(names)}), or set "
                    "data.unmapped_code_values=keep if these raw values also occur"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} is not of the form key=value, e.g. teacher.target_epsilon=4"
        )
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else None
    return key.strip().split("."), value


def _apply_override(tree: dict, keys: list[str], value: Any) -> None:
    node = tree
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(keys)}: {k!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            fix = "remove it or check the spelling against the documented fields"
        elif e["type"] == "missing":
            fix = "add it to the config"
        else:
            fix = "change the value"
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        lines.append(f"  - {where}{shown}: {e['msg']} ({fix})")
    return "\n".join(lines)


def config_from_dict(tree: dict) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"invalid config ({e.error_count()} problem(s)):\n{_format_errors(e)}") from e


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML config, apply dotted `key=value` overrides, validate everything at once."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass an existing YAML file")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    for item in overrides or []:
        keys, value = _parse_override(item)
        _apply_override(tree, keys, value)
    return config_from_dict(tree)


def dump_config(cfg: PipelineConfig) -> str:
    """The resolved config as YAML (what a run directory keeps)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
