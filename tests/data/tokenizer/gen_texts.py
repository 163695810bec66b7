#!/usr/bin/python3
"""Writes the tokenizer test inputs in this folder (deterministic; re-run to regenerate):
  texts.json   hand-written cases: English, code, numbers, whitespace runs, newlines, CJK,
               emoji, accented and decomposed text, special tokens in text, empty string;
  random.json  400 random concatenations of tricky fragments (fixed seed);
  nfc.json     [input, NFC(input)] pairs from Python's unicodedata for the C NFC code.
Then the goldens come from the JS reference (see README.md)."""
import json
import os
import random
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))

TEXTS = [
    '',
    'Hello world',
    'Hello, world! How are you doing today?',
    'The quick brown fox jumps over the lazy dog.',
    ' leading space',
    '  two leading spaces and trailing  ',
    "I'm sure you've seen it; they'll say we'd go. It's John's.",
    "I'M SURE YOU'VE SEEN IT; THEY'LL SAY WE'D GO. IT'S JOHN'S. DON'T",
    'int main(void) {\n    printf("%d\\n", 42);\n    return 0;\n}\n',
    'def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n\treturn -x\n',
    'for (i = 0; i < n; i++) { a[i] = b[i] + c[i]; } // C code',
    '<div class="box">&nbsp;<a href=\'https://example.com/a?b=1&c=2\'>link</a></div>',
    'Numbers: 0 7 42 123 1234 12345 123456789 3.14159 -2.5e10 1,000,000 $19.99 50%',
    '2024-01-15T10:30:00Z and 192.168.0.1:8080',
    'spaces     between      words',
    'tabs\tand\t\ttabs',
    'line one\nline two\n\nline four\n\n\n',
    'windows\r\nline\r\nendings\r\n',
    '   \n   \n  ',
    '\n',
    ' ',
    '     ',
    'Chinese: \u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002',
    'Japanese: \u3053\u3093\u306b\u3061\u306f\u3001\u4e16\u754c\u3002\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a\u3001\u6f22\u5b57\u3002',
    'Korean: \uc548\ub155\ud558\uc138\uc694 \uc138\uacc4',
    'Emoji: \U0001f389\U0001f680\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 \u2764\ufe0f \U0001f600\U0001f603\U0001f604',
    'Accents: caf\xe9 na\xefve r\xe9sum\xe9 Z\xfcrich fa\xe7ade S\xe3o Paulo \xc5ngstr\xf6m',
    'Decomposed: cafe\u0301 nai\u0308ve A\u030angstro\u0308m',
    'Greek and Cyrillic: \u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5, \u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440',
    'Arabic: \u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 and Hebrew: \u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd',
    'Math: \u2211\u222b\u221a\u221e \u2264 \u2265 \u2260 \u03b1 \u03b2 \u03b3 \xbd \xb2 \xb3',
    'Mixed123abc 456def abc789 x1y2z3',
    '!!!??? ... --- *** ### @@@',
    '\'quoted\' "double" `backtick` \'s \'t alone\'',
    '<s>Hello</s>',
    'Hello <s> world </s> end',
    '<|begin_of_text|>Hi<|eot_id|>',
    '<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>',
    '<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n',
    '<think>\nreasoning\n</think>\n\nanswer',
    '<tool_call>{"name": "f"}</tool_call>',
    '<|endoftext|><|endoftext|>',
    'a<|im_end|>b',
    'no special <s tokens> here <|not_special|>',
    '\xa0non-breaking\xa0space and\u3000ideographic space',
    'zero\u200bwidth and soft\xadhyphen',
    '\u2581metaspace\u2581char and <0x41> literal',
    'supercalifragilisticexpialidocious antidisestablishmentarianism',
    'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
    '\xdcn\xefc\xf6d\xe9 \xc0\xc9\xce\xd5\xdc \xe0\xe9\xee\xf5\xfc \xdf \u1e9e',
    ("In the beginning of the project, the team decided to write everything in C. "
     "They measured, they tested, and they wrote it down. ") * 4,
]

FRAGS = ["the", " the", "The", " quick", "brown", " fox", "'s", "'S", "'ll", "'LL", "'re", "'ve",
         "'d", "'m", "'t", "'x", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0",
         "\u3000", "\u2028", "\u0085", "\u200b", "1", "12", "123", "1234", "12345", "3.14", "-",
         "--", "...", "!", "?", "(", ")", "{", "}", "[", "]", "<", ">", "/", "\\", "\"", "'", "`",
         "#", "$", "%", "&", "*", "_", "=", "+", "|", "~", "^", "@", "\u00e9", "e\u0301", "\u00f1",
         "n\u0303", "\u00fc", "u\u0308", "\u00c5", "A\u030a", "\ufb01", "\u03a9", "\u212b",
         "\u1100\u1161", "\u1100\u1161\u11a8", "\uac00", "\uac01", "\u0344", "\u0958",
         "\u4f60\u597d", "\u4e16\u754c", "\u3053\u3093\u306b\u3061\u306f",
         "\u30ab\u30bf\u30ab\u30ca", "\ud55c\uad6d\uc5b4", "\u041f\u0440\u0438\u0432\u0435\u0442",
         "\u03b5\u03bb\u03bb\u03ac\u03b4\u03b1", "\u05e2\u05d1\u05e8\u05d9\u05ea",
         "\u0627\u0644\u0639\u0631\u0628\u064a\u0629", "\u0939\u093f\u0928\u094d\u0926\u0940",
         "\u0e44\u0e17\u0e22", "\U0001F389", "\U0001F44D\U0001F3FD",
         "\U0001F468\u200d\U0001F469\u200d\U0001F467", "\u2764\ufe0f", "\U0001F1FA\U0001F1F8",
         "\U0001F600", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
         "<think>", "</think>", "<tool_call>", "<|begin_of_text|>", "<|eot_id|>",
         "<|start_header_id|>", "\u2581", "\u2581\u2581", "<0x41>", "\u017f", "\u01c4", "\u01c5",
         "\u0130", "\u212a", "supercalifragilistic", "antidisestablishment", "aaaaaaa", "zzzz",
         "xyz", "Qwerty", "camelCase", "snake_case", "URL", "http://x.io/a?b=c", "\x00", "\x01",
         "\x7f", "\ufeff", "\ufffd"]


def nfc_cases():
    out = []
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        n = unicodedata.normalize("NFC", c)
        if n != c or unicodedata.combining(c):
            out.append(c)
    rng = random.Random(11)
    marks = [chr(c) for c in (0x300, 0x301, 0x302, 0x303, 0x308, 0x30A, 0x316, 0x323, 0x327,
                              0x328, 0x331, 0x334, 0x345, 0x5B0, 0x93C, 0x9BE, 0x3099, 0x309A)]
    bases = ["a", "e", "o", "u", "A", "O", "n", "c", "\u03b1", "\u03c9", "\u0438", "\u304b",
             "\u1100", "\u1161", "\u11a8", "\uac00", "\u0915", "\u09c7", " ", "x"]
    for _ in range(600):
        s = "".join(rng.choice(bases) + "".join(rng.choice(marks) for _ in range(rng.randint(0, 3)))
                    for _ in range(rng.randint(1, 6)))
        out.append(s)
    return [[s, unicodedata.normalize("NFC", s)] for s in out]


def main():
    def dump(name, obj):
        with open(os.path.join(HERE, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=0)
            f.write("\n")
    dump("texts.json", TEXTS)
    rng = random.Random(7)
    dump("random.json", ["".join(rng.choice(FRAGS) for _ in range(rng.randint(1, 25)))
                         for _ in range(400)])
    dump("nfc.json", nfc_cases())


if __name__ == "__main__":
    main()
