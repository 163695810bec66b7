/* UTF-8 and the few Unicode algorithms the tokenizer needs (classes, NFC), over the
 * generated tables in unicode_tables.c. Lossy decoding follows the WHATWG "maximal subpart"
 * rule, which is what Rust's String::from_utf8_lossy (Hugging Face tokenizers) and
 * JavaScript's TextDecoder both do, so U+FFFD counts agree with the references. */
#include "tokenizer/unicode.h"

#include <stdlib.h>
#include <string.h>

#include "util/status.h"

size_t pd_utf8_decode(const uint8_t *s, size_t n, uint32_t *cp, bool *valid)
{
    uint8_t b0 = s[0];
    if (b0 < 0x80) {
        *cp = b0;
        *valid = true;
        return 1;
    }
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF;
    uint32_t c;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        need = 1;
        c = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
        need = 2;
        c = b0 & 0x0F;
        if (b0 == 0xE0)
            lo = 0xA0;
        else if (b0 == 0xED)
            hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        need = 3;
        c = b0 & 0x07;
        if (b0 == 0xF0)
            lo = 0x90;
        else if (b0 == 0xF4)
            hi = 0x8F;
    } else {
        *cp = 0xFFFD;
        *valid = false;
        return 1;
    }
    size_t i = 1;
    for (; i <= need; i++) {
        if (i >= n || s[i] < lo || s[i] > hi) {
            *cp = 0xFFFD;
            *valid = false;
            return i;
        }
        c = (c << 6) | (s[i] & 0x3F);
        lo = 0x80;
        hi = 0xBF;
    }
    *cp = c;
    *valid = true;
    return i;
}

size_t pd_utf8_encode(uint32_t cp, uint8_t *out)
{
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

size_t pd_utf8_complete_prefix(const uint8_t *s, size_t n)
{
    /* Only the last 3 bytes can start a truncated sequence. */
    size_t start = n > 3 ? n - 3 : 0;
    /* Walk from a character boundary: step back over continuation bytes is not enough
     * (they may be invalid strays), so decode forward from a safe point. */
    size_t i = 0;
    if (start > 0) {
        /* Any position whose byte is not a continuation byte is a decode boundary for the
         * lossy decoder unless it sits inside a valid sequence that started earlier; a
         * valid sequence is at most 4 bytes, so starting 3 bytes further back suffices. */
        i = start > 3 ? start - 3 : 0;
        while (i < start && (s[i] & 0xC0) == 0x80) i++;
    }
    while (i < n) {
        uint32_t cp;
        bool ok;
        size_t k = pd_utf8_decode(s + i, n - i, &cp, &ok);
        if (!ok && i + k == n) {
            /* Invalid only because the input ended? Then hold it back. */
            uint8_t b0 = s[i];
            size_t need = b0 >= 0xF0 ? 3 : b0 >= 0xE0 ? 2 : 1;
            if (b0 >= 0xC2 && b0 <= 0xF4 && k <= need) return i;
        }
        i += k;
    }
    return n;
}

size_t pd_utf8_lossy(const uint8_t *s, size_t n, uint8_t *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        bool ok;
        size_t k = pd_utf8_decode(s + i, n - i, &cp, &ok);
        if (ok) {
            memcpy(out + o, s + i, k);
            o += k;
        } else {
            o += pd_utf8_encode(0xFFFD, out + o);
        }
        i += k;
    }
    return o;
}

static const pd_uc_range *range_find(const pd_uc_range *r, unsigned n, uint32_t cp)
{
    unsigned lo = 0, hi = n;
    while (lo < hi) {
        unsigned mid = (lo + hi) / 2;
        if (cp < r[mid].lo)
            hi = mid;
        else if (cp > r[mid].hi)
            lo = mid + 1;
        else
            return &r[mid];
    }
    return NULL;
}

unsigned pd_uc_class(uint32_t cp)
{
    if (cp < 128) return pd_uc_ascii_class[cp];
    const pd_uc_range *r = range_find(pd_uc_class_ranges, pd_uc_class_count, cp);
    return r ? r->val : 0;
}

/* ---- case ---------------------------------------------------------------------------- */

size_t pd_uc_case(uint32_t cp, int mode, uint32_t out[3])
{
    static const struct {
        const pd_uc_case_run *runs;
        const unsigned *nr;
        const pd_uc_case_full *full;
        const unsigned *nf;
    } tables[] = {
        [PD_UC_UPPER] = {pd_uc_upper_runs, &pd_uc_upper_run_count, pd_uc_upper_full,
                         &pd_uc_upper_full_count},
        [PD_UC_LOWER] = {pd_uc_lower_runs, &pd_uc_lower_run_count, pd_uc_lower_full,
                         &pd_uc_lower_full_count},
        [PD_UC_TITLE] = {pd_uc_title_runs, &pd_uc_title_run_count, pd_uc_title_full,
                         &pd_uc_title_full_count},
    };
    const pd_uc_case_run *runs = tables[mode].runs;
    const pd_uc_case_full *full = tables[mode].full;
    unsigned nr = *tables[mode].nr, nf = *tables[mode].nf;
    out[0] = cp;
    unsigned lo = 0, hi = nr; /* the runs are disjoint intervals */
    while (lo < hi) {
        unsigned mid = (lo + hi) / 2;
        if (cp < runs[mid].lo)
            hi = mid;
        else if (cp > runs[mid].hi)
            lo = mid + 1;
        else if ((cp - runs[mid].lo) % runs[mid].step == 0) {
            out[0] = (uint32_t)((int32_t)cp + runs[mid].delta);
            return 1;
        } else {
            break; /* between a step-2 run's code points: maybe a full mapping (U+1F52) */
        }
    }
    for (lo = 0, hi = nf; lo < hi;) {
        unsigned mid = (lo + hi) / 2;
        if (full[mid].cp < cp)
            lo = mid + 1;
        else if (full[mid].cp > cp)
            hi = mid;
        else {
            memcpy(out, full[mid].out, full[mid].n * sizeof *out);
            return full[mid].n;
        }
    }
    return 1;
}

bool pd_uc_is_cased(uint32_t cp)
{
    return range_find(pd_uc_cased, pd_uc_cased_count, cp) != NULL;
}

bool pd_uc_is_case_ignorable(uint32_t cp)
{
    return range_find(pd_uc_case_ignorable, pd_uc_case_ignorable_count, cp) != NULL;
}

/* ---- NFC ------------------------------------------------------------------------------ */

enum {
    SBASE = 0xAC00,
    LBASE = 0x1100,
    VBASE = 0x1161,
    TBASE = 0x11A7,
    LCOUNT = 19,
    VCOUNT = 21,
    TCOUNT = 28,
    NCOUNT = VCOUNT * TCOUNT,
    SCOUNT = LCOUNT * NCOUNT,
};

static unsigned ccc_of(uint32_t cp)
{
    if (cp < 0x300) return 0;
    const pd_uc_range *r = range_find(pd_uc_ccc_ranges, pd_uc_ccc_count, cp);
    return r ? r->val : 0;
}

static const pd_uc_decomp *decomp_of(uint32_t cp)
{
    unsigned lo = 0, hi = pd_uc_decomp_count;
    while (lo < hi) {
        unsigned mid = (lo + hi) / 2;
        if (pd_uc_decomps[mid].cp < cp)
            lo = mid + 1;
        else if (pd_uc_decomps[mid].cp > cp)
            hi = mid;
        else
            return &pd_uc_decomps[mid];
    }
    return NULL;
}

/* Composite of a + b, or 0 when they do not compose. */
static uint32_t compose(uint32_t a, uint32_t b)
{
    if (a >= LBASE && a < LBASE + LCOUNT && b >= VBASE && b < VBASE + VCOUNT)
        return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT;
    if (a >= SBASE && a < SBASE + SCOUNT && (a - SBASE) % TCOUNT == 0 && b > TBASE &&
        b < TBASE + TCOUNT)
        return a + (b - TBASE);
    unsigned lo = 0, hi = pd_uc_comp_count;
    while (lo < hi) {
        unsigned mid = (lo + hi) / 2;
        const pd_uc_pair *p = &pd_uc_comps[mid];
        if (p->a < a || (p->a == a && p->b < b))
            lo = mid + 1;
        else if (p->a > a || p->b > b)
            hi = mid;
        else
            return p->c;
    }
    return 0;
}

int pd_uc_nfc(const uint8_t *s, size_t n, uint8_t **out, size_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    bool need = false;
    for (size_t i = 0; i < n && !need;) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        bool ok;
        i += pd_utf8_decode(s + i, n - i, &cp, &ok);
        need = range_find(pd_uc_nfc_unsafe, pd_uc_nfc_unsafe_count, cp) != NULL;
    }
    if (!need) return 0;

    /* A full canonical decomposition has at most 4 code points (Hangul: 3), and every
     * code point that decomposes takes at least 2 UTF-8 bytes, so 4 per byte is a bound. */
    size_t cap = n * 4 + 4;
    uint32_t *buf = malloc(cap * sizeof *buf); /* (cap) code points */
    if (!buf) return pd_error(PD_ENOMEM, "nfc: out of memory");
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        bool ok;
        i += pd_utf8_decode(s + i, n - i, &cp, &ok);
        if (cp >= SBASE && cp < SBASE + SCOUNT) {
            uint32_t si = cp - SBASE;
            buf[m++] = LBASE + si / NCOUNT;
            buf[m++] = VBASE + (si % NCOUNT) / TCOUNT;
            if (si % TCOUNT) buf[m++] = TBASE + si % TCOUNT;
            continue;
        }
        const pd_uc_decomp *d = cp >= 0xC0 ? decomp_of(cp) : NULL;
        if (d) {
            if (m + d->len + 3 > cap) { /* cannot happen with the bound above; stay safe */
                free(buf);
                return pd_error(PD_EINTERNAL, "nfc: decomposition bound exceeded");
            }
            memcpy(buf + m, pd_uc_decomp_pool + d->off, d->len * sizeof *buf);
            m += d->len;
        } else {
            buf[m++] = cp;
        }
    }
    /* Canonical ordering: stable insertion sort of each run of non-starters by class. */
    for (size_t i = 1; i < m; i++) {
        unsigned c = ccc_of(buf[i]);
        if (c == 0) continue;
        size_t j = i;
        uint32_t x = buf[i];
        while (j > 0) {
            unsigned pc = ccc_of(buf[j - 1]);
            if (pc == 0 || pc <= c) break;
            buf[j] = buf[j - 1];
            j--;
        }
        buf[j] = x;
    }
    /* Canonical composition (UAX #15). */
    if (m > 0) {
        size_t starter = 0, w = 1;
        unsigned last = ccc_of(buf[0]);
        if (last != 0) last = 256; /* no starter yet: nothing may compose with buf[0] */
        for (size_t r = 1; r < m; r++) {
            uint32_t ch = buf[r];
            unsigned c = ccc_of(ch);
            uint32_t comp = last == 256 ? 0 : compose(buf[starter], ch);
            if (comp && (last < c || last == 0)) {
                buf[starter] = comp;
                continue;
            }
            if (c == 0) {
                starter = w;
                last = 0;
            } else {
                last = last == 256 ? 256 : c;
            }
            buf[w++] = ch;
        }
        m = w;
    }
    uint8_t *o = malloc(m * 4 + 1);
    if (!o) {
        free(buf);
        return pd_error(PD_ENOMEM, "nfc: out of memory");
    }
    size_t ol = 0;
    for (size_t i = 0; i < m; i++) ol += pd_utf8_encode(buf[i], o + ol);
    free(buf);
    o[ol] = 0;
    *out = o;
    *out_len = ol;
    return 0;
}
