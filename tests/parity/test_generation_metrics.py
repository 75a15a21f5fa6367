"""Generation metrics against the reference packages: exact match (plain and SQuAD-normalised, written out here
as SQuAD's evaluate script does it), ROUGE-1/2/L/Lsum against Google's rouge_score (per pair, and the mean of
the per-pair F-measures we report), BLEU and chrF against sacrebleu's corpus_bleu / corpus_chrf with defaults,
and our Porter stemmer against nltk's PorterStemmer(). The C++ side runs through build/trainer_metrics_tool.
"""
import json
import random
import re
import string
import subprocess

import pytest
import sacrebleu
from nltk.stem.porter import PorterStemmer
from rouge_score import rouge_scorer

ROUGE_TYPES = ["rouge1", "rouge2", "rougeL", "rougeLsum"]
TOLERANCE = 1e-9


@pytest.fixture(scope="session")
def metrics_tool(built_tool):
    return built_tool("trainer_metrics_tool", "TRAINER_METRICS_TOOL")


def run_tool(tool, predictions, references, use_stemmer, stem_words=None):
    request = {"predictions": predictions, "references": references, "use_stemmer": use_stemmer}
    if stem_words is not None:
        request["stem_words"] = stem_words
    result = subprocess.run([str(tool)], input=json.dumps(request), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def squad_normalize(s):
    # SQuAD v1.1 evaluate-v1.1.py normalize_answer, as HF evaluate's "squad" metric uses it.
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def close(ours, theirs, what):
    assert abs(ours - theirs) <= TOLERANCE, f"{what}: ours {ours!r}, reference {theirs!r}"


def check_all(tool, predictions, references, use_stemmer):
    ours = run_tool(tool, predictions, references, use_stemmer)
    n = len(predictions)

    plain = sum(p == r for p, r in zip(predictions, references)) / n
    normalized = sum(squad_normalize(p) == squad_normalize(r) for p, r in zip(predictions, references)) / n
    assert ours["exact_match"] == plain
    assert ours["exact_match_normalized"] == normalized
    assert ours["named"]["exact_match"] == plain

    scorer = rouge_scorer.RougeScorer(ROUGE_TYPES, use_stemmer=use_stemmer)
    pair_scores = [scorer.score(r, p) for p, r in zip(predictions, references)]
    for i, scores in enumerate(pair_scores):
        for rouge_type in ROUGE_TYPES:
            for field in ("precision", "recall", "fmeasure"):
                close(ours["rouge_pairs"][i][rouge_type][field], getattr(scores[rouge_type], field),
                      f"pair {i} {rouge_type} {field} (pred {predictions[i][:60]!r}, ref {references[i][:60]!r})")
    for rouge_type in ROUGE_TYPES:
        mean_f = sum(s[rouge_type].fmeasure for s in pair_scores) / n
        close(ours["rouge"][rouge_type]["fmeasure"], mean_f, f"mean {rouge_type}")
        close(ours["named"][rouge_type], mean_f, f"named {rouge_type}")

    bleu = sacrebleu.corpus_bleu(predictions, [references])
    close(ours["bleu"]["score"], bleu.score, "bleu")
    close(ours["named"]["bleu"], bleu.score, "named bleu")
    for k in range(4):
        close(ours["bleu"]["precisions"][k], bleu.precisions[k], f"bleu precision {k + 1}")
    close(ours["bleu"]["bp"], bleu.bp, "bleu brevity penalty")
    assert ours["bleu"]["sys_len"] == bleu.sys_len
    assert ours["bleu"]["ref_len"] == bleu.ref_len

    chrf = sacrebleu.corpus_chrf(predictions, [references])
    close(ours["chrf"], chrf.score, "chrf")
    close(ours["named"]["chrf"], chrf.score, "named chrf")
    return ours


FIXED_PAIRS = [
    ("The cat sat on the mat.", "The cat sat on the mat."),
    ("the cat sat on the mat", "The cat sat on the mat."),
    ("A quick brown fox jumps over the lazy dog", "The quick brown fox jumped over a lazy dog!"),
    ("", "something to say"),
    ("nothing expected here", ""),
    ("", ""),
    ("Running runners ran; happiness generously conditional, skies dying.", "The runner runs happily in the sky."),
    ("Élan vital: café, naïve façade — 東京タワー and Ünïcödé’s “quotes”.", "elan vital cafe naive facade Tokyo tower"),
    ("İstanbul KELVIN \u212a degrees, Straße ΟΔΟΣ.", "istanbul kelvin k degrees strasse οδος"),
    ("First sentence here.\nSecond sentence there.\n\nThird one!", "First sentence there.\nSecond sentence here.\nThird one."),
    ("one\ntwo\nthree", "three\ntwo\none"),
    ("the the the the cat cat", "the cat the cat the cat"),
    ("Prices rose 3.5% to $1,234.56 on 2026-11-27 (vs. 1,200.00).", "Prices rose 3.5 % to $ 1,234.56 on 2026-11-27."),
    ("AT&amp;T &lt;b&gt; said &quot;hi&quot; <skipped> well-\nknown", "AT&T <b> said \"hi\" well-known"),
    ("tabs\tand\u00a0no-break\u2003spaces\u3000here  ", "tabs and no-break spaces here"),
    ("An apple a day; the answer is: an Apple!", "apple day answer is apple"),
    ("12 345 6789 x1y2z3", "12 345 6789 x1 y2 z3"),
    ("Don't stop-believing... ok?!", "dont stop believing ok"),
    ("   ", "\n\n"),
    ("!!!", "???"),
    # Exact match after Python's lower(): final sigma (ς only at a word's end), dotted capital I (i + U+0307).
    ("\u039f\u0394\u039f\u03a3.", "\u03bf\u03b4\u03bf\u03c2"),
    ("\u039f\u0394\u039f\u03a3", "\u03bf\u03b4\u03bf\u03c3"),
    ("\u03a3\u0391\u03a3 the", "\u03c3\u03b1\u03c2"),
    ("\u0130stanbul", "i\u0307stanbul"),
    ("Theatre a-n the_a", "theatre an the_a"),
]


@pytest.mark.parametrize("use_stemmer", [False, True])
def test_fixed_pairs_equal_the_references(metrics_tool, use_stemmer):
    predictions = [p for p, _ in FIXED_PAIRS]
    references = [r for _, r in FIXED_PAIRS]
    check_all(metrics_tool, predictions, references, use_stemmer)


@pytest.mark.parametrize("index", range(len(FIXED_PAIRS)))
def test_each_pair_alone_equals_the_references(metrics_tool, index):
    # Corpus BLEU and chrF of one segment exercise the zero-count and smoothing branches pair by pair.
    prediction, reference = FIXED_PAIRS[index]
    check_all(metrics_tool, [prediction], [reference], use_stemmer=True)


def test_exact_match_values(metrics_tool):
    ours = run_tool(metrics_tool, ["The Answer.", "answer", "x"], ["answer", "answer", "y"], False)
    assert ours["exact_match"] == pytest.approx(1 / 3)
    assert ours["exact_match_normalized"] == pytest.approx(2 / 3)


WORDS = ("the a an of and model answer summary generate generation generated generating running runner ran "
         "happiness happily happy conditional conditioning national rational relational sensational "
         "hopeful hopefully hopefulness goodness electrical electricity formalize formality sensibility "
         "adjustable adjustment dependent dependence irritant replacement adoption communism activate "
         "angularity homologous effective bowdlerize probate rate cease controlling filing agreed feed "
         "plastered bled motoring sing conflated troubled sized hopping tanned falling hissing fizzed failing "
         "filing happy sky skies dying lying tying news innings outing cannings howe proceed exceed succeed "
         "ponies ties caresses cats feud generalization oscillators analogous archaeology biology apology "
         "triplicate formative hopefulli fulli analogousli radically tr cry crying by try yesterday "
         "syzygy yyy toy toys enjoy enjoyed bys ayed 2026 3d abc123 x1y2").split()


def test_porter_stemmer_equals_nltk(metrics_tool):
    rng = random.Random(1234)
    words = list(WORDS)
    # Random lowercase words with English-like suffixes reach every rule's branch, including the odd ones.
    suffixes = ["ing", "ed", "ies", "ied", "sses", "ational", "tional", "alli", "logi", "bli", "izer", "ation",
                "ousness", "iviti", "biliti", "icate", "ative", "alize", "ful", "ness", "ement", "ion", "ize",
                "ll", "e", "y", "eed", "at", "bl", "iz", "s", "fulli", "entli", "ousli", "eli", "ism", "ous"]
    for _ in range(3000):
        stem = "".join(rng.choice("abcdeilmnoprstuvwyz") for _ in range(rng.randint(1, 7)))
        words.append(stem + rng.choice(suffixes))
    ours = run_tool(metrics_tool, ["x"], ["x"], False, stem_words=words)["stems"]
    stemmer = PorterStemmer()
    mismatches = [(w, o, stemmer.stem(w)) for w, o in zip(words, ours) if o != stemmer.stem(w)]
    assert not mismatches, mismatches[:20]


def random_text(rng, vocabulary, min_words, max_words):
    words = []
    for _ in range(rng.randint(min_words, max_words)):
        word = rng.choice(vocabulary)
        roll = rng.random()
        if roll < 0.08:
            word += rng.choice([".", ",", "!", "?", ";", ":", "'s", "-", "%"])
        elif roll < 0.12:
            word = word.capitalize()
        elif roll < 0.14:
            word += "\n"
        words.append(word)
    return " ".join(words)


@pytest.mark.parametrize("use_stemmer", [False, True])
def test_randomized_pairs_equal_the_references(metrics_tool, use_stemmer):
    rng = random.Random(20261127 + use_stemmer)
    vocabulary = WORDS + ["café", "naïve", "東京", "ΟΔΟΣ", "İzmir", "1,000.5", "3.14", "U.S.", "e-mail", "&amp;",
                          "\u00a0", "(", ")", "\"", "—", "…"]
    predictions, references = [], []
    for _ in range(200):
        reference = random_text(rng, vocabulary, 0, 40)
        if rng.random() < 0.3:
            # A prediction close to its reference: shared n-grams of every order.
            tokens = reference.split(" ")
            rng.shuffle(tokens[: len(tokens) // 3])
            prediction = " ".join(tokens[: rng.randint(0, len(tokens))])
        else:
            prediction = random_text(rng, vocabulary, 0, 40)
        predictions.append(prediction)
        references.append(reference)
    check_all(metrics_tool, predictions, references, use_stemmer)


def test_very_long_texts(metrics_tool):
    rng = random.Random(7)
    reference = random_text(rng, WORDS, 2000, 2000)
    tokens = reference.split(" ")
    prediction = " ".join(tokens[100:1500] + tokens[:100] + ["extra"] * 50)
    check_all(metrics_tool, [prediction, reference], [reference, prediction], use_stemmer=True)


def test_mismatched_lengths_are_an_error(metrics_tool):
    request = {"predictions": ["a", "b"], "references": ["a"], "use_stemmer": False}
    result = subprocess.run([str(metrics_tool)], input=json.dumps(request), capture_output=True, text=True)
    assert result.returncode != 0
    assert "2 predictions but 1 references" in result.stderr
