/* Internals of the chat-template Jinja subset (common/tokenizer/jinja_*.c), shared by the
 * compiler (jinja_parse.c: lexer + parser -> tree) and the interpreter (jinja_eval.c).
 *
 * Design: the compiler turns the template into an immutable tree allocated in one arena
 * owned by the template; every name it can resolve (filters, tests, methods, global
 * functions) becomes an enum id at compile time, so anything outside the subset fails at
 * load and rendering never meets an unknown name. Rendering allocates all its values in a
 * per-render arena that is dropped in one place; values are small structs passed by value
 * (strings are pointer + length, containers point into the arena).
 */
#ifndef PD_TOKENIZER_JINJA_INTERNAL_H
#define PD_TOKENIZER_JINJA_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "util/arena.h"

/* ---- values ------------------------------------------------------------------------- */

typedef enum {
    JV_UNDEF = 0, /* a missing variable, key or index */
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST,   /* list or tuple (jlist.tuple) */
    JV_DICT,   /* insertion-ordered mapping */
    JV_NS,     /* namespace(): a mapping whose attributes `set ns.x` may assign */
    JV_LOOP,   /* the `loop` object of a for */
    JV_FUNC,   /* a global function (raise_exception, range, ...) */
    JV_METHOD, /* a bound method: self + method id */
} jv_kind;

typedef struct jlist jlist;
typedef struct jdict jdict;
typedef struct jloop jloop;
typedef struct jv jv;

struct jv {
    uint8_t kind; /* jv_kind */
    uint8_t fn;   /* JV_FUNC: jfunc id; JV_METHOD: jmethod id */
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *p; /* UTF-8, not NUL-terminated; arena or template storage */
            size_t n;      /* bytes */
        } s;
        jlist *l;
        jdict *d; /* JV_DICT, JV_NS */
        jloop *lp;
        jv *self; /* JV_METHOD: the receiver (arena copy) */
    } u;
};

struct jlist {
    size_t n, cap;
    jv *v; /* (n) items */
    bool tuple;
    /* A one-shot iterator, as the select/reject/selectattr/rejectattr/map/unique/items filters
     * return in jinja2: always true, no length, not subscriptable, not JSON; iterating it
     * consumes it (v and n advance). */
    bool gen;
    const char *fail; /* a generator that raises this error once iterated (items of a
                         non-mapping), else NULL */
};

struct jdict {
    size_t n, cap;
    jv *k; /* (n) keys, insertion order */
    jv *v; /* (n) values */
};

struct jloop {
    int64_t index0, length;
    const jv *items; /* (length) the iterated items, for previtem/nextitem */
};

/* ---- ids resolved at compile time ----------------------------------------------------- */

typedef enum {
    JF_TRIM,
    JF_LENGTH,
    JF_TOJSON,
    JF_JOIN,
    JF_LIST,
    JF_ITEMS,
    JF_STRING,
    JF_FIRST,
    JF_LAST,
    JF_UPPER,
    JF_LOWER,
    JF_REPLACE,
    JF_DEFAULT,
    JF_INT,
    JF_FLOAT,
    JF_ABS,
    JF_SELECT,
    JF_REJECT,
    JF_SELECTATTR,
    JF_REJECTATTR,
    JF_MAP,
    JF_UNIQUE,
    JF__COUNT
} jfilter;

typedef enum {
    JT_DEFINED,
    JT_UNDEFINED,
    JT_NONE,
    JT_TRUE,
    JT_FALSE,
    JT_BOOLEAN,
    JT_STRING,
    JT_NUMBER,
    JT_INTEGER,
    JT_FLOAT,
    JT_MAPPING,
    JT_ITERABLE,
    JT_SEQUENCE,
    JT_EQ,
    JT_NE,
    JT_IN,
    JT__COUNT
} jtest;

typedef enum {
    JM_STRIP,
    JM_LSTRIP,
    JM_RSTRIP,
    JM_STARTSWITH,
    JM_ENDSWITH,
    JM_SPLIT,
    JM_UPPER,
    JM_LOWER,
    JM_REPLACE,
    JM_TITLE,
    JM_ITEMS,
    JM_KEYS,
    JM_VALUES,
    JM_GET,
    JM__COUNT
} jmethod;

typedef enum {
    JG_RAISE_EXCEPTION,
    JG_STRFTIME_NOW,
    JG_NAMESPACE,
    JG_RANGE,
    JG_DICT,
    JG__COUNT
} jfunc;

/* Name -> id lookups (-1 when not in the subset). */
int jinja_filter_id(const char *name, size_t n);
int jinja_test_id(const char *name, size_t n);
int jinja_method_id(const char *name, size_t n);
int jinja_func_id(const char *name, size_t n);
const char *jinja_method_name(int id);
const char *jinja_func_name(int id);

/* ---- tree ------------------------------------------------------------------------------ */

typedef enum {
    /* expressions */
    JE_CONST,
    JE_NAME,
    JE_GETATTR,
    JE_GETITEM,
    JE_SLICE,
    JE_CALL,
    JE_FILTER,
    JE_TEST,
    JE_NOT,
    JE_NEG,
    JE_POS,
    JE_BIN,
    JE_AND,
    JE_OR,
    JE_COMPARE,
    JE_CONCAT,
    JE_COND,
    JE_LIST,
    JE_TUPLE,
    JE_DICT,
    /* statements */
    JS_TEXT,
    JS_PRINT,
    JS_IF,
    JS_FOR,
    JS_SET,
    JS_SET_ATTR,
    JS_SET_BLOCK,
    JS_BREAK,
    JS_CONTINUE,
    JS_GENERATION,
} jnode_kind;

typedef enum {
    JOP_ADD,
    JOP_SUB,
    JOP_MUL,
    JOP_DIV,
    JOP_FLOORDIV,
    JOP_MOD,
    JOP_POW,
    JOP_EQ,
    JOP_NE,
    JOP_LT,
    JOP_LE,
    JOP_GT,
    JOP_GE,
    JOP_IN,
    JOP_NOTIN,
} jop;

typedef struct jnode jnode;
struct jnode {
    uint8_t kind;         /* jnode_kind */
    int op;               /* jop, or the filter/test id, or a JS_SET target count */
    int line;             /* 1-based source line */
    jnode *a, *b, *c, *d; /* children; meaning per kind (see jinja_parse.c) */
    jnode **args;         /* (nargs) positional and keyword arguments, list items, ... */
    const char **kw;      /* (nargs) keyword name per argument, NULL for positional; may be NULL */
    int nargs;
    int *ops;           /* JE_COMPARE: (nargs) jop per comparison */
    const char *name;   /* JE_NAME, JE_GETATTR, JS_SET_ATTR attribute; NUL-terminated */
    size_t name_n;      /* strlen(name) */
    int method;         /* JE_GETATTR: jmethod id of name, -1 when it names no method */
    const char **names; /* JS_FOR / JS_SET targets: (op) names */
    jv lit;             /* JE_CONST, JS_TEXT */
    jnode *next;        /* next statement in a body */
};

typedef struct {
    pd_arena *arena; /* owns every node and literal */
    jnode *body;     /* first top-level statement */
} jinja_program;

/* Compiles source into *prog (arena created here; destroy it to free). Status and message
 * as chat_template.h documents for pd_chat_compile. */
int jinja_compile(const char *source, const char *what, jinja_program *prog);

/* Renders prog with vars (a JSON object) into a malloc'd string. now_unix: the time
 * strftime_now() sees. Status and message as chat_template.h documents for pd_chat_render. */
int jinja_render(const jinja_program *prog, const json_t *vars, int64_t now_unix, char **out,
                 size_t *out_len);

/* Python whitespace (str.isspace) for a code point. */
bool jinja_is_space(uint32_t cp);

#endif
