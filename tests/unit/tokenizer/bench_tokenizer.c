/* bench_tokenizer: encode and incremental-decode throughput on one core.
 *
 * Usage: bench_tokenizer [--mb N] [--seed S] MODEL_DIR...
 * Builds N MB (default 4) of English-like text, deterministic from the seed: sentences of
 * words drawn from a Zipf distribution over a fixed list of common English words, with
 * capitals, punctuation, numbers and paragraph breaks. For each tokenizer it reports
 *   encode (document)  the whole text in one pd_tok_encode call (word cache active);
 *   encode (prompts)   the same text as independent 2 KiB prompts (no cache);
 *   detok              pd_detok_push over the resulting ids, one at a time;
 * in MB/s of input text (1 MB = 1e6 bytes) and tokens/s, best of 3 runs, from the
 * process CPU time (single-threaded: the time on one core, not inflated when other
 * processes share the machine); the wall-clock figure is printed next to it.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tokenizer/tokenizer.h"
#include "util/clock.h"
#include "util/status.h"

static const char *const WORDS[] = {
    "the",
    "of",
    "and",
    "to",
    "a",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "I",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "not",
    "word",
    "but",
    "what",
    "some",
    "we",
    "can",
    "out",
    "other",
    "were",
    "all",
    "there",
    "when",
    "up",
    "use",
    "your",
    "how",
    "said",
    "an",
    "each",
    "she",
    "which",
    "do",
    "their",
    "time",
    "if",
    "will",
    "way",
    "about",
    "many",
    "then",
    "them",
    "write",
    "would",
    "like",
    "so",
    "these",
    "her",
    "long",
    "make",
    "thing",
    "see",
    "him",
    "two",
    "has",
    "look",
    "more",
    "day",
    "could",
    "go",
    "come",
    "did",
    "number",
    "sound",
    "no",
    "most",
    "people",
    "my",
    "over",
    "know",
    "water",
    "than",
    "call",
    "first",
    "who",
    "may",
    "down",
    "side",
    "been",
    "now",
    "find",
    "any",
    "new",
    "work",
    "part",
    "take",
    "get",
    "place",
    "made",
    "live",
    "where",
    "after",
    "back",
    "little",
    "only",
    "round",
    "man",
    "year",
    "came",
    "show",
    "every",
    "good",
    "me",
    "give",
    "our",
    "under",
    "name",
    "very",
    "through",
    "just",
    "form",
    "sentence",
    "great",
    "think",
    "say",
    "help",
    "low",
    "line",
    "differ",
    "turn",
    "cause",
    "much",
    "mean",
    "before",
    "move",
    "right",
    "boy",
    "old",
    "too",
    "same",
    "tell",
    "does",
    "set",
    "three",
    "want",
    "air",
    "well",
    "also",
    "play",
    "small",
    "end",
    "put",
    "home",
    "read",
    "hand",
    "port",
    "large",
    "spell",
    "add",
    "even",
    "land",
    "here",
    "must",
    "big",
    "high",
    "such",
    "follow",
    "act",
    "why",
    "ask",
    "men",
    "change",
    "went",
    "light",
    "kind",
    "off",
    "need",
    "house",
    "picture",
    "try",
    "us",
    "again",
    "animal",
    "point",
    "mother",
    "world",
    "near",
    "build",
    "self",
    "earth",
    "father",
    "head",
    "stand",
    "own",
    "page",
    "should",
    "country",
    "found",
    "answer",
    "school",
    "grow",
    "study",
    "still",
    "learn",
    "plant",
    "cover",
    "food",
    "sun",
    "four",
    "between",
    "state",
    "keep",
    "eye",
    "never",
    "last",
    "let",
    "thought",
    "city",
    "tree",
    "cross",
    "farm",
    "hard",
    "start",
    "might",
    "story",
    "saw",
    "far",
    "sea",
    "draw",
    "left",
    "late",
    "run",
    "don't",
    "while",
    "press",
    "close",
    "night",
    "real",
    "life",
    "few",
    "north",
    "open",
    "seem",
    "together",
    "next",
    "white",
    "children",
    "begin",
    "got",
    "walk",
    "example",
    "ease",
    "paper",
    "group",
    "always",
    "music",
    "those",
    "both",
    "mark",
    "often",
    "letter",
    "until",
    "mile",
    "river",
    "car",
    "feet",
    "care",
    "second",
    "book",
    "carry",
    "took",
    "science",
    "eat",
    "room",
    "friend",
    "began",
    "idea",
    "fish",
    "mountain",
    "stop",
    "once",
    "base",
    "hear",
    "horse",
    "cut",
    "sure",
    "watch",
    "color",
    "face",
    "wood",
    "main",
    "enough",
    "plain",
    "girl",
    "usual",
    "young",
    "ready",
    "above",
    "ever",
    "red",
    "list",
    "though",
    "feel",
    "talk",
    "bird",
    "soon",
    "body",
    "dog",
    "family",
    "direct",
    "pose",
    "leave",
    "song",
    "measure",
    "door",
    "product",
    "black",
    "short",
    "numeral",
    "class",
    "wind",
    "question",
    "happen",
    "complete",
    "ship",
    "area",
    "half",
    "rock",
    "order",
    "fire",
    "south",
    "problem",
    "piece",
    "told",
    "knew",
    "pass",
    "since",
    "top",
    "whole",
    "king",
    "space",
    "heard",
    "best",
    "hour",
    "better",
    "true",
    "during",
    "hundred",
    "five",
    "remember",
    "step",
    "early",
    "hold",
    "west",
    "ground",
    "interest",
    "reach",
    "fast",
    "verb",
    "sing",
    "listen",
    "six",
    "table",
    "travel",
    "less",
    "morning",
    "ten",
    "simple",
    "several",
    "vowel",
    "toward",
    "war",
    "lay",
    "against",
    "pattern",
    "slow",
    "center",
    "love",
    "person",
    "money",
    "serve",
    "appear",
    "road",
    "map",
    "rain",
    "rule",
    "govern",
    "pull",
    "cold",
    "notice",
    "voice",
    "unit",
    "power",
    "town",
    "fine",
    "certain",
    "fly",
    "fall",
    "lead",
    "cry",
    "dark",
    "machine",
    "note",
    "wait",
    "plan",
    "figure",
    "star",
    "box",
    "noun",
    "field",
    "rest",
    "correct",
    "able",
    "pound",
    "done",
    "beauty",
    "drive",
    "stood",
    "contain",
    "front",
    "teach",
    "week",
    "final",
    "gave",
    "green",
    "oh",
    "quick",
    "develop",
    "ocean",
    "warm",
    "free",
    "minute",
    "strong",
    "special",
    "mind",
    "behind",
    "clear",
    "tail",
    "produce",
    "fact",
    "street",
    "inch",
    "multiply",
    "nothing",
    "course",
    "stay",
    "wheel",
    "full",
    "force",
    "blue",
    "object",
    "decide",
    "surface",
    "deep",
    "moon",
    "island",
    "foot",
    "system",
    "busy",
    "test",
    "record",
    "boat",
    "common",
    "gold",
    "possible",
    "plane",
    "stead",
    "dry",
    "wonder",
    "laugh",
    "thousand",
    "ago",
    "ran",
    "check",
    "game",
    "shape",
    "equate",
    "hot",
    "miss",
    "brought",
    "heat",
    "snow",
    "tire",
    "bring",
    "yes",
    "distant",
    "fill",
    "east",
    "paint",
    "language",
    "among",
    "tokenizer",
    "disaggregated",
    "inference",
    "throughput",
    "latency",
    "scheduler",
    "transformer",
    "attention",
    "weights",
    "benchmark",
    "measurement",
    "implementation",
    "representation",
    "international",
    "responsibility",
    "understanding",
    "unfortunately",
    "characteristics",
    "it's",
    "we're",
    "they've",
    "I'll",
    "she'd",
};
#define N_WORDS (sizeof WORDS / sizeof WORDS[0])

static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU and wall seconds since (c0, w0). */
typedef struct {
    double cpu, wall;
} span;
static span since(double c0, double w0)
{
    return (span){cpu_s() - c0, pd_now_s() - w0};
}

static uint64_t rng_state;
static uint64_t rng(void)
{
    rng_state += 0x9E3779B97F4A7C15ull;
    uint64_t z = rng_state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Zipf(1) over the word list by inverse CDF. */
static double *zipf_cdf;
static size_t pick_word(void)
{
    double u = (double)(rng() >> 11) / 9007199254740992.0;
    size_t lo = 0, hi = N_WORDS - 1;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (zipf_cdf[mid] < u)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static char *make_text(size_t bytes, size_t *len)
{
    zipf_cdf = malloc(N_WORDS * sizeof *zipf_cdf);
    double s = 0;
    for (size_t i = 0; i < N_WORDS; i++) s += 1.0 / (double)(i + 1);
    double acc = 0;
    for (size_t i = 0; i < N_WORDS; i++) {
        acc += 1.0 / (double)(i + 1) / s;
        zipf_cdf[i] = acc;
    }
    char *t = malloc(bytes + 256);
    size_t n = 0;
    while (n < bytes) {
        int words = 6 + (int)(rng() % 18);
        for (int w = 0; w < words && n < bytes; w++) {
            const char *word = WORDS[pick_word()];
            if (w > 0) t[n++] = ' ';
            if (rng() % 40 == 0) {
                n += (size_t)sprintf(t + n, "%u", (unsigned)(rng() % 100000));
                continue;
            }
            size_t l = strlen(word);
            memcpy(t + n, word, l);
            if (w == 0 && t[n] >= 'a' && t[n] <= 'z') t[n] = (char)(t[n] - 32);
            n += l;
            if (w + 1 < words && rng() % 12 == 0) t[n++] = ',';
        }
        t[n++] = rng() % 10 == 0 ? '?' : '.';
        if (rng() % 8 == 0) {
            t[n++] = '\n';
            t[n++] = '\n';
        } else {
            t[n++] = ' ';
        }
    }
    t[n] = 0;
    *len = n;
    free(zipf_cdf);
    return t;
}

int main(int argc, char **argv)
{
    double mb = 4;
    rng_state = 42;
    int first = 1;
    while (first < argc && strncmp(argv[first], "--", 2) == 0) {
        if (strcmp(argv[first], "--mb") == 0 && first + 1 < argc)
            mb = atof(argv[++first]);
        else if (strcmp(argv[first], "--seed") == 0 && first + 1 < argc)
            rng_state = strtoull(argv[++first], NULL, 10);
        else {
            fprintf(stderr, "usage: bench_tokenizer [--mb N] [--seed S] MODEL_DIR...\n");
            return 2;
        }
        first++;
    }
    if (first >= argc || mb <= 0) {
        fprintf(stderr, "usage: bench_tokenizer [--mb N] [--seed S] MODEL_DIR...\n");
        return 2;
    }
    size_t len;
    char *text = make_text((size_t)(mb * 1e6), &len);
    printf("text: %.2f MB of English-like text (Zipf over %zu words)\n", (double)len / 1e6,
           N_WORDS);
    for (int a = first; a < argc; a++) {
        pd_tok *t;
        double t0 = pd_now_s();
        if (pd_tok_load(argv[a], &t) < 0) {
            fprintf(stderr, "bench_tokenizer: %s\n", pd_last_error());
            return 1;
        }
        double load_s = pd_now_s() - t0;
        span best_doc = {1e30, 1e30}, best_pr = {1e30, 1e30}, best_det = {1e30, 1e30};
        int32_t *ids = NULL;
        size_t n = 0, n_pr = 0;
        for (int rep = 0; rep < 3; rep++) {
            free(ids);
            double c0 = cpu_s(), w0 = pd_now_s();
            if (pd_tok_encode(t, text, len, false, &ids, &n) < 0) {
                fprintf(stderr, "bench_tokenizer: %s\n", pd_last_error());
                return 1;
            }
            span dt = since(c0, w0);
            if (dt.cpu < best_doc.cpu) best_doc = dt;
            /* 2 KiB prompts, cut at a space so words are not split */
            c0 = cpu_s();
            w0 = pd_now_s();
            n_pr = 0;
            for (size_t off = 0; off < len;) {
                size_t end = off + 2048 < len ? off + 2048 : len;
                while (end < len && text[end] != ' ') end++;
                int32_t *p;
                size_t np;
                if (pd_tok_encode(t, text + off, end - off, false, &p, &np) < 0) {
                    fprintf(stderr, "bench_tokenizer: %s\n", pd_last_error());
                    return 1;
                }
                n_pr += np;
                free(p);
                off = end;
            }
            dt = since(c0, w0);
            if (dt.cpu < best_pr.cpu) best_pr = dt;
            pd_detok *d;
            if (pd_detok_create(t, true, NULL, 0, &d) < 0) return 1;
            c0 = cpu_s();
            w0 = pd_now_s();
            size_t out = 0;
            for (size_t i = 0; i < n; i++) {
                const char *delta;
                size_t dl;
                if (pd_detok_push(d, ids[i], &delta, &dl) < 0) return 1;
                out += dl;
            }
            dt = since(c0, w0);
            pd_detok_free(d);
            if (dt.cpu < best_det.cpu) best_det = dt;
            if (out != len) {
                fprintf(stderr, "bench_tokenizer: detok produced %zu bytes, text has %zu\n", out,
                        len);
                return 1;
            }
        }
        double mbytes = (double)len / 1e6;
        printf("%s: load %.3f s, %zu tokens (%.2f bytes/token)\n", argv[a], load_s, n,
               (double)len / (double)n);
        printf("  encode (document): %7.2f MB/s  %10.0f tokens/s   (wall: %.2f MB/s)\n",
               mbytes / best_doc.cpu, (double)n / best_doc.cpu, mbytes / best_doc.wall);
        printf("  encode (prompts) : %7.2f MB/s  %10.0f tokens/s   (wall: %.2f MB/s; %zu tokens)\n",
               mbytes / best_pr.cpu, (double)n_pr / best_pr.cpu, mbytes / best_pr.wall, n_pr);
        printf("  detok push       : %7.2f MB/s  %10.0f tokens/s   (wall: %.2f MB/s)\n",
               mbytes / best_det.cpu, (double)n / best_det.cpu, mbytes / best_det.wall);
        free(ids);
        pd_tok_free(t);
    }
    free(text);
    return 0;
}
