/* One table of every flag and environment setting of pdserve's executables (pd-prefill,
 * pd-decode, pd-scheduler), from which parsing, --help and the environment fallbacks come.
 *
 * Design (llama.cpp's common/arg.cpp: one table for every binary): flags.c holds the table —
 * each entry's name, kind, value range or choices, environment variable, the roles it has an
 * effect in, and its help. One command line serves every role (the Ascend guide's
 * start_servers.sh passes the same flags to all three), so a role accepts every flag of the
 * table: one that has no effect there is checked and ignored, and vLLM's flags that have no
 * effect anywhere (--swap-space, --trust-remote-code, ...) are checked and logged. An executable
 * binds the flags it uses to fields of its own params struct (pd_flag_bind: an offset and a C
 * type); the defaults stay in its default-params function (one definition), and --help prints
 * them from there. vLLM spellings: "--max_model_len" is "--max-model-len", and "--flag=value"
 * is "--flag value". */
#ifndef PD_UTIL_FLAGS_H
#define PD_UTIL_FLAGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The executables (a flag's roles are a mask of these). */
#define PD_ROLE_PREFILL   1u
#define PD_ROLE_DECODE    2u
#define PD_ROLE_SCHEDULER 4u
#define PD_ROLE_NODES     (PD_ROLE_PREFILL | PD_ROLE_DECODE)
#define PD_ROLE_ALL       (PD_ROLE_NODES | PD_ROLE_SCHEDULER)

typedef enum {
    PD_FLAG_STRING, /* --flag VALUE */
    PD_FLAG_NAMES,  /* --flag N [N...]: the values up to the next flag */
    PD_FLAG_INT,    /* a whole number in [lo, hi] */
    PD_FLAG_NUMBER, /* a finite number in [lo, hi] ((lo, hi] with lo_open) */
    PD_FLAG_CHOICE, /* one of choices */
    PD_FLAG_SWITCH, /* no value; with negatable, --no-<name> turns it off */
} pd_flag_kind;

/* Where a bound value goes in a role's params struct. */
typedef enum {
    PD_BIND_STR,  /* const char *: the value (CHOICE: the canonical choice; NAMES: the first) */
    PD_BIND_STRV, /* const char *[max] at off, int count at count_off (NAMES; a flag given
                     again adds its names to the list) */
    PD_BIND_BOOL, /* bool: SWITCH on/off; CHOICE: choice index != 0 */
    PD_BIND_INT,  /* int: INT; NUMBER rounded up to a whole number */
    PD_BIND_I64,  /* int64_t */
    PD_BIND_SIZE, /* size_t */
    PD_BIND_F64,  /* double */
    PD_BIND_FUNC, /* fn(params, flag name, value; a switch: "1") */
    PD_BIND_NONE, /* checked and listed in --help, nothing stored (a value it only accepts) */
} pd_bind_type;

typedef struct {
    const char
        *name; /* the table's flag ("--max-model-len") or environment setting ("NODE_PORTS") */
    pd_bind_type type;
    size_t off;       /* offsetof(params, field) */
    size_t count_off; /* STRV: offsetof(params, count) */
    int max;          /* STRV: entries at most */
    int (*fn)(void *params, const char *flag, const char *value); /* FUNC */
    const char *help; /* this role's help where it differs from the table's, or NULL */
    const char *dflt; /* the default as --help says it ("the model's"), or NULL: the value in
                         the defaults, and "" to say none */
} pd_flag_bind;

#define PD_BIND(T, flag, btype, field)                                                             \
    {                                                                                              \
        .name = (flag), .type = (btype), .off = offsetof(T, field)                                 \
    }

/* Parses argv[1..argc) for role (one PD_ROLE_* bit) into params, which holds the role's
 * defaults; then each bound environment setting (and each bound flag's environment fallback)
 * that the command line did not set. *help is set on -h/--help (parsing stops there). Strings
 * borrow argv/environ. PD_EINVAL with a message naming the flag or variable: "unknown flag
 * '--x' (see --help)", "--x: missing value", "--x takes no value", "--x: expected an integer
 * in [1, 4096], got \"y\"", "--x: expected auto, tcp or nccl, got 'y'". */
int pd_flags_parse(unsigned role, const pd_flag_bind *binds, size_t n_binds, int argc, char **argv,
                   void *params, bool *help);

/* Writes role's --help: the synopsis line and intro (caller's text), every flag of the table
 * bound for role with its help and its default read from defaults (role's default params), the
 * environment settings, the other roles' flags accepted and ignored, and vLLM's flags accepted
 * with no effect. */
void pd_flags_usage(FILE *out, unsigned role, const char *synopsis, const char *intro,
                    const pd_flag_bind *binds, size_t n_binds, const void *defaults);

/* Applies argv's --log-level L (or --log-level=L; the last one) before the flags are parsed, so
 * that what parsing logs (vLLM's no-op flags, --enforce-eager) already follows it. A bad value is
 * left for the parser to report. */
void pd_flags_early_log_level(int argc, char **argv);

#endif
