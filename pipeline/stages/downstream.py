"""Does the synthetic data serve a downstream task? (issue 20)

The DP synthetic-text literature (Yue et al. 2023; Private Evolution, Xie et al. 2024) judges
synthetic data by a classifier trained on it and tested on real data. Here the task is the
control codes themselves: for each code column, a TF-IDF + logistic-regression classifier is
trained on synthetic texts with the codes they were prompted with, and tested on the real
test split. Beside it:
- `real_reference`: the same classifier cross-validated (5 folds) on the real test split:
  what real data of that size gives. Never trained on the training split, whose every
  release must stay inside ε; the test split is held out and listed under "Not protected";
- `majority`: always the test split's most frequent value;
- `chance_macro_f1`: the better macro-F1 of two label-blind predictors (the majority class;
  random labels with the test frequencies, whose expected macro-F1 is 1/K).

MAUVE (Pillutla et al. 2021, `mauve-text`) compares the synthetic texts with as many real
test texts, with features from the DP teacher: the last layer's hidden state at each text's
last token, as the MAUVE paper does with GPT-2. 1 means the two sets are indistinguishable
in that feature space. About 10-30 s on 2 cores for 1,000 texts a side.

Only aggregates leave: accuracy and macro-F1 per column, one MAUVE score. No text, no
per-record prediction or feature.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch

from pipeline.records import CODE_JOINER

log = logging.getLogger(__name__)

MEASURES = ("whether the synthetic text carries what distinguishes the codes in real text: a classifier trained "
            "on it, tested on the real test split (not whether the DP teacher recognises its codes: code adherence)")
CHANCE_MARGIN = 0.05  # macro-F1 within this of chance: the classifier learned nothing usable
REFERENCE_FOLDS = 5


def _classifier(seed: int):
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    return make_pipeline(
        TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True, max_features=100_000),
        LogisticRegression(max_iter=2000, class_weight="balanced", random_state=seed),
    )


def _scores(y_true: list[str], y_pred: list[str]) -> dict[str, float]:
    from sklearn.metrics import accuracy_score, f1_score

    return {"accuracy": float(accuracy_score(y_true, y_pred)),
            "macro_f1": float(f1_score(y_true, y_pred, average="macro", zero_division=0))}


def _real_reference(texts: list[str], labels: list[str], seed: int) -> dict[str, float] | None:
    """Cross-validated on the real test split (stratified when every value has enough records)."""
    from sklearn.model_selection import KFold, StratifiedKFold, cross_val_predict

    if len(texts) < 2 * REFERENCE_FOLDS:
        return None
    smallest = min(Counter(labels).values())
    folds = (StratifiedKFold(REFERENCE_FOLDS, shuffle=True, random_state=seed) if smallest >= REFERENCE_FOLDS
             else KFold(REFERENCE_FOLDS, shuffle=True, random_state=seed))
    try:
        pred = cross_val_predict(_classifier(seed), texts, labels, cv=folds)
    except ValueError:  # a fold with one value only, or a vocabulary emptied by min_df
        return None
    return _scores(labels, list(pred))


def _column(values: list[list[str]], j: int) -> list[str]:
    return [v[j] if j < len(v) else "" for v in values]


def code_classification(synthetic_codes: list[str], synthetic_texts: list[str], test_codes: list[str],
                        test_texts: list[str], code_columns: list[str], seed: int = 0) -> dict:
    """Per code column: the synthetic-trained classifier on the real test split, the real
    reference, the majority baseline and chance; `useful`: False when every column scored is at
    chance. Codes are the joined control codes (`CODE_JOINER`) of each sample and record."""
    syn = [c.split(CODE_JOINER) for c in synthetic_codes]
    real = [c.split(CODE_JOINER) for c in test_codes]
    columns: dict[str, dict] = {}
    for j, column in enumerate(code_columns):
        y_syn, y_test = _column(syn, j), _column(real, j)
        values = Counter(y_test)
        if len(set(y_syn)) < 2 or len(values) < 2:
            columns[column] = {"skipped": "fewer than two values in the synthetic or the test codes"}
            continue
        try:
            clf = _classifier(seed).fit(synthetic_texts, y_syn)
        except ValueError as e:  # e.g. no word occurs twice: an empty vocabulary
            columns[column] = {"skipped": f"the classifier could not be trained on the synthetic texts ({e})"}
            continue
        synthetic = _scores(y_test, list(clf.predict(test_texts)))
        top, n_top = values.most_common(1)[0]
        majority = _scores(y_test, [top] * len(y_test))
        chance_f1 = max(1 / len(values), majority["macro_f1"])
        columns[column] = {
            "values": len(values), "synthetic_train": len(y_syn), "test": len(y_test),
            "synthetic": synthetic, "real_reference": _real_reference(test_texts, y_test, seed),
            "majority": majority, "chance_macro_f1": chance_f1,
            "at_chance": synthetic["macro_f1"] <= chance_f1 + CHANCE_MARGIN,
        }
    scored = [c for c in columns.values() if "synthetic" in c]
    return {"measures": MEASURES, "columns": columns, "classifier": "TF-IDF (1-2 grams) + logistic regression",
            "useful": None if not scored else not all(c["at_chance"] for c in scored)}


def classification_lines(result: dict) -> list[str]:
    """One line per column for logs and the report."""
    out = []
    for column, c in result["columns"].items():
        if "skipped" in c:
            out.append(f"{column}: skipped ({c['skipped']})")
            continue
        ref = c["real_reference"]
        out.append(f"{column}: macro-F1 {c['synthetic']['macro_f1']:.3f} (accuracy {c['synthetic']['accuracy']:.3f}) "
                   f"trained on synthetic, {'-' if ref is None else format(ref['macro_f1'], '.3f')} real reference, "
                   f"{c['chance_macro_f1']:.3f} chance{' (AT CHANCE)' if c['at_chance'] else ''}")
    return out


def length_ratio(text_properties: dict, stat: str = "mean") -> float | None:
    """Token length of the synthetic texts over that of the real test texts, these cut at the
    longest synthetic text (`tokens_capped`) when known; `stat`: 'mean' or 'median'."""
    try:
        real = text_properties["real_test"]
        return text_properties["synthetic"]["tokens"][stat] / real.get("tokens_capped", real["tokens"])[stat]
    except (KeyError, ZeroDivisionError, TypeError):
        return None


MAUVE_TEXTS = 1_000  # texts a side: MAUVE's k-means wants a few thousand points in all


@torch.no_grad()
def _last_token_features(model, tok, texts: list[str], batch_size: int, max_length: int) -> np.ndarray:
    """(N, H) final hidden state at each text's last token (cut to `max_length` tokens)."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(texts), batch_size):
        ids = [tok.encode(t, add_special_tokens=False)[:max_length] or [tok.eos_token_id]
               for t in texts[start : start + batch_size]]
        lengths = torch.tensor([len(x) for x in ids])
        batch = torch.full((len(ids), int(lengths.max())), tok.pad_token_id, dtype=torch.long)
        for row, x in enumerate(ids):
            batch[row, : len(x)] = torch.tensor(x)
        mask = (torch.arange(batch.shape[1])[None, :] < lengths[:, None]).long()
        hidden = model(input_ids=batch.to(device), attention_mask=mask.to(device),
                       output_hidden_states=True).hidden_states[-1].float()  # (B, L, H)
        out.append(hidden[torch.arange(len(ids)), lengths.to(device) - 1].cpu().numpy())  # (B, H)
    return np.concatenate(out)


def mauve_score(model, tok, synthetic_texts: list[str], real_texts: list[str], batch_size: int = 32,
                max_length: int = 128, seed: int = 0) -> dict | None:
    """MAUVE between the synthetic and the real texts (the same number of each, at most
    MAUVE_TEXTS) on `model`'s features; None when either side has fewer than 50 texts."""
    n = min(len(synthetic_texts), len(real_texts), MAUVE_TEXTS)
    if n < 50:
        return None
    import mauve  # needs faiss: imported only when it runs
    p = _last_token_features(model, tok, synthetic_texts[:n], batch_size, max_length)
    q = _last_token_features(model, tok, real_texts[:n], batch_size, max_length)
    result = mauve.compute_mauve(p_features=p, q_features=q, device_id=-1, verbose=False, seed=seed + 25,
                                 num_buckets=max(2, min(n // 10, 50)))
    return {"mauve": float(result.mauve), "texts": n, "features": "DP teacher, last layer, last token"}
