"""Our tokenizers against the Python libraries: every id of `encode`, the special tokens transformers adds,
and `decode` with and without special tokens must be exactly what `tokenizers` / `sentencepiece` /
`transformers` give, on a varied set of texts and on every tokenizer in tests/assets/tokenizers (made by
make_tokenizers.py there) and the shipped tiny models.

The C++ side is the GoogleTest TokenizerExternal.*, run with TRAINER_TOKENIZER_CASES naming the cases file."""
import json
import os
import random
import subprocess
import unicodedata

import pytest
import sentencepiece
from tokenizers import Tokenizer

JSON_TOKENIZERS = ["tests/assets/tokenizers/gpt2-bytelevel", "tests/assets/tokenizers/gpt2-prefix-nfkc",
                   "tests/assets/tokenizers/qwen2-style", "tests/assets/tokenizers/llama3-style",
                   "tests/assets/tokenizers/clip-style", "configs/models/tiny-qwen2"]
SPM_TOKENIZERS = ["tests/assets/tokenizers/spm-unigram", "tests/assets/tokenizers/spm-bpe", "configs/models/tiny-t5"]
# Directories transformers loads (AutoTokenizer): their `tokenizer(text)` ids must equal ours with the template.
TRANSFORMERS_DIRS = ["tests/assets/tokenizers/qwen2-style", "tests/assets/tokenizers/llama3-style",
                     "tests/assets/tokenizers/clip-style", "configs/models/tiny-qwen2"]

FIXED_TEXTS = [
    "", " ", "  ", "\n", "\t", "a", "Hello world", " Hello world ", "Hello  world", "Hello   \n\n  world\n",
    "Whisk the eggs until smooth.", "Fold in the flour", "The quick brown fox jumps over the lazy dog.", "I'm sure it's fine; they'll say we've done what I'd do.",
    "DON'T SHOUT! IT'S NOT WHAT YOU'RE THINKING, I'LL SAY. We'Ll, WE'lL, wE'D, THEY'VE, she'S", "'s 't 're",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "東京は日本の首都です。我喜欢吃饺子。한국어 문장도 있습니다.", "Привет, мир! Ελληνικά. עברית. العربية.",
    "😀👍🏽👨‍👩‍👧‍👦🏳️‍🌈❤️‍🔥🇩🇪 emoji 🙂🙃", "👩🏾‍💻 and 🧑‍🤝‍🧑 and #️⃣ 1️⃣",
    "café naïve résumé", "cafe\u0301 nai\u0308ve re\u0301sume\u0301", "e\u0301\u0301\u0323 a\u030a Å Å",
    "ﬁne ﬂour ｆｕｌｌ ｗｉｄｔｈ ² ½ Ⅻ ㎏", "1234567890 12 345 6,789.01 3.14159 -42 1e10 0x1F",
    "many          spaces          here", " " * 40 + "x", "\t\t\tTabs\tand\t\tmore\ttabs\t", "a\r\nb\rc\n\r\nd",
    "trailing spaces   ", "   leading spaces", "\u00a0non-breaking\u00a0space\u2003em space\u3000ideographic",
    "zero\u200bwidth\u200djoiner\u2060", "\u0085next line", "line\u2028separator", "tab\x0bvtab\x0cff",
    "control \x00 \x01 \x7f chars", "e-mail: someone@example.com, https://example.com/a?b=c&d=e#f",
    "She said: \"Hello!\" — and left… ’twas 'quoted' «text» „so“.", "¿Qué? ¡Sí! Ça va. Straße. İstanbul. ǅ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 𐍈 outside the BMP", "x" * 300, "ab" * 150 + " " + "😀" * 30,
    # long words take the heap merge path
    "Supercalifragilistic" * 200, "".join(random.Random(7).choice("abcdefghijklmnopqrstuvwxyzETAOIN") for _ in range(5000)),
]
# Added tokens written in the text: special ones, and gpt2-bytelevel's [MASK] (lstrip/rstrip), foo
# (single_word), wörld and "new token" (normalized), and <sep> (a sentencepiece user-defined symbol).
SPECIAL_TEXTS = [
    "<|endoftext|>", "Hello<|endoftext|>world", "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|><|endoftext|>b <|endoftext|> c", "<|endoftext", "<|begin_of_text|>Hi<|eot_id|><|end_of_text|>",
    "a [MASK] b", "a   [MASK]   b", "[MASK][MASK]", "x[MASK]y", "foo bar foofoo food _foo foo_ (foo) foo1 foo",
    "hello wörld, wörlds, new token, newtoken, new  token", "<|user|> hi <|pad|>", "</s> and </s>", "a<sep>b <sep> c",
    "<s>hello</s>", "ﬁsh ﬁ Ⅻ XII", "<|startoftext|>A Photo of a CAR<|endoftext|>", "a photo<|endoftext|>",
    # Lowercase: one-to-many (U+0130), Greek capital sigma at a word's end (no context rule), title case, Deseret
    "İstanbul İ", "ΟΔΟΣ Σ σ", "ǅ ǈ ǋ", "𐐀𐐁 ÀÉÎÕÜ ẞ",
]


def random_texts(n=150, seed=1234):
    """Seeded mixtures of the hard parts: scripts, marks, emoji pieces, whitespace, digits, apostrophes."""
    pieces = ["the", "The", "THE", "'s", "'S", "'ll", "'LL", "'Re", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n",
              "0", "42", "1234567", "3.5", "東", "京都", "한", "ё", "ß", "é", "e\u0301", "\u0301", "\u0308", "😀", "👍",
              "\U0001F3FD", "\u200d", "👨", "👩", "\ufe0f", "🇩", "🇪", "<", ">", "|", "_", "-", "—", "...", "'", "\"",
              "{", "}", "(", ")", ";", "=", "+", "#", "@", "$", "%", "^", "&", "*", "/", "\\", "~", "`", "ﬁ", "½",
              "\u00a0", "\u3000", "world", "Word", "x", "Zebra", "data_1", "camelCase", "snake_case"]
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def ascii_texts(n=150, seed=99):
    """Seeded printable-ASCII texts: the sentencepiece tokenizer encodes these word by word through a cache
    (repeated words, runs of spaces, leading and trailing spaces, every punctuation character)."""
    rng = random.Random(seed)
    words = ["the", "eggs", "Whisk", "smooth.", "1.", "2", "cups", "don't", "(x)", "a,b", "<s>", "</s>", "<sep>"]
    words += [chr(c) for c in range(0x21, 0x7f)]
    return ["".join(rng.choice(words) + rng.choice([" ", " ", "  ", ""]) for _ in range(rng.randint(1, 30)))
            for _ in range(n)]


def all_texts(root):
    texts = FIXED_TEXTS + SPECIAL_TEXTS + random_texts() + ascii_texts()
    texts += [unicodedata.normalize("NFD", t) for t in FIXED_TEXTS[16:24]]
    with open(root / "data" / "demo" / "recipes-causal.jsonl", encoding="utf-8") as f:
        for _, line in zip(range(20), f):
            record = json.loads(line)
            texts.append(record["prompt"] + record["completion"])
    return texts


def spm_file(directory):
    for name in ("spiece.model", "tokenizer.model"):
        if (directory / name).exists():
            return directory / name
    raise FileNotFoundError(directory)


@pytest.fixture(scope="module")
def ours(root, trainer_binary, tmp_path_factory):
    """Runs TokenizerExternal.* on every (tokenizer, text) case; returns {(dir, text): result}."""
    tests_binary = trainer_binary.parent / "trainer_tests"
    if not tests_binary.exists():
        pytest.fail(f"{tests_binary} does not exist: build first")
    cases = [(d, t) for d in JSON_TOKENIZERS + SPM_TOKENIZERS for t in all_texts(root)]
    path = tmp_path_factory.mktemp("tokenizer") / "cases.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for directory, text in cases:
            f.write(json.dumps({"tokenizer": str(root / directory), "text": text}) + "\n")
    env = dict(os.environ, TRAINER_TOKENIZER_CASES=str(path))
    result = subprocess.run([str(tests_binary), "--gtest_filter=TokenizerExternal.*"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SKIPPED" not in result.stdout.split("[==========]")[-1], result.stdout
    with open(str(path) + ".out.jsonl", encoding="utf-8") as f:
        outputs = [json.loads(line) for line in f]
    assert len(outputs) == len(cases)
    return {case: output for case, output in zip(cases, outputs)}


def check(ours_result, directory, text, ids, with_special, decoded, decoded_special):
    assert "error" not in ours_result, f"{directory}: {text!r}: {ours_result.get('error')}"
    for key, expected in [("ids", ids), ("with_special", with_special), ("decoded", decoded),
                          ("decoded_special", decoded_special)]:
        assert ours_result[key] == expected, f"{directory}: {key} of {text!r}: ours {ours_result[key]!r}, theirs {expected!r}"


@pytest.mark.parametrize("directory", JSON_TOKENIZERS)
def test_tokenizer_json_matches_tokenizers(root, ours, directory):
    reference = Tokenizer.from_file(str(root / directory / "tokenizer.json"))
    mismatches = []
    for text in all_texts(root):
        ids = reference.encode(text, add_special_tokens=False).ids
        with_special = reference.encode(text).ids
        try:
            check(ours[(directory, text)], directory, text, ids, with_special,
                  reference.decode(with_special, skip_special_tokens=True),
                  reference.decode(with_special, skip_special_tokens=False))
        except AssertionError as error:
            mismatches.append(str(error))
    assert not mismatches, f"{len(mismatches)} mismatches, first ones:\n" + "\n".join(mismatches[:10])


@pytest.mark.parametrize("directory", SPM_TOKENIZERS)
def test_sentencepiece_matches_sentencepiece(root, ours, directory):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_file(root / directory)))
    is_t5 = spm_file(root / directory).name == "spiece.model"
    mismatches = []
    for text in all_texts(root):
        ids = sp.encode(text)
        with_special = ids + [sp.eos_id()] if is_t5 else [sp.bos_id()] + ids
        special_piece = sp.id_to_piece(with_special[-1] if is_t5 else with_special[0])
        decoded = sp.decode(ids)
        decoded_special = decoded + special_piece if is_t5 else special_piece + decoded
        try:
            check(ours[(directory, text)], directory, text, ids, with_special, decoded, decoded_special)
        except AssertionError as error:
            mismatches.append(str(error))
    assert not mismatches, f"{len(mismatches)} mismatches, first ones:\n" + "\n".join(mismatches[:10])


@pytest.mark.parametrize("directory", TRANSFORMERS_DIRS)
def test_special_tokens_match_transformers(root, ours, directory):
    """transformers' tokenizer(text) (add_special_tokens=True, tokenizer_config.json read) gives our
    special_token_template() around our ids, and the same eos/pad/bos."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(root / directory))
    for text in all_texts(root)[:60]:
        result = ours[(directory, text)]
        assert result["with_special"] == reference(text)["input_ids"], f"{directory}: {text!r}"
        assert (result["eos_id"], result["pad_id"], result["bos_id"]) == (
            reference.eos_token_id, reference.pad_token_id, reference.bos_token_id)


def test_t5_appends_eos_as_transformers(root, ours):
    """T5Tokenizer (transformers) appends </s> to every sequence: our template does too."""
    transformers = pytest.importorskip("transformers")
    directory = "configs/models/tiny-t5"
    reference = transformers.AutoTokenizer.from_pretrained(str(root / directory), extra_ids=0)
    for text in ["Whisk the eggs until smooth.", "Fold in the flour"]:
        expected = reference(text)["input_ids"]
        assert expected[-1] == reference.eos_token_id == 1
        assert ours[(directory, text)]["with_special"][-1] == 1
        assert ours[(directory, text)]["with_special"] == expected


def test_decode_round_trips(root, ours):
    """Without a normalizer decode(encode(text)) is the text itself; with NFC (Qwen2's pipeline) it is NFC(text)."""
    for directory, normal in [("tests/assets/tokenizers/llama3-style", lambda t: t),
                              ("configs/models/tiny-qwen2", lambda t: unicodedata.normalize("NFC", t))]:
        for text in FIXED_TEXTS + random_texts():
            result = ours[(directory, text)]
            assert result["decoded"] == normal(text), f"{directory}: {text!r}"
