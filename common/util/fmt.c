/* Shortest round-trip float formatting (see fmt.h). The digits come from trying %.{p}e for
 * p = 0..16 until strtod gives back the same double; the layout then follows Python's repr. */
#include "util/fmt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t pd_fmt_double(double v, char *buf, size_t n)
{
    char tmp[64];
    if (isnan(v)) return (size_t)snprintf(buf, n, "nan");
    if (isinf(v)) return (size_t)snprintf(buf, n, v > 0 ? "inf" : "-inf");
    if (v == 0) return (size_t)snprintf(buf, n, signbit(v) ? "-0.0" : "0.0");
    /* shortest mantissa digits that round-trip */
    int prec = 0;
    for (; prec < 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec, v);
        if (strtod(tmp, NULL) == v) break;
    }
    /* tmp = [-]d.ddddde[+-]XX : split digits and exponent */
    char digits[32];
    int nd = 0, neg = tmp[0] == '-';
    const char *p = tmp + neg;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    digits[nd] = '\0';
    int exp10 = atoi(p + 1); /* value = 0.d1d2... * 10^(exp10 + 1) */
    while (nd > 1 && digits[nd - 1] == '0') digits[--nd] = '\0';
    char out[64];
    int o = 0;
    if (neg) out[o++] = '-';
    if (exp10 >= -5 + 1 && exp10 < 16) { /* fixed: Python uses it for -4 <= exp10 < 16 */
        if (exp10 < 0) {
            out[o++] = '0';
            out[o++] = '.';
            for (int i = 0; i < -exp10 - 1; i++) out[o++] = '0';
            for (int i = 0; i < nd; i++) out[o++] = digits[i];
        } else {
            for (int i = 0; i <= exp10; i++) out[o++] = i < nd ? digits[i] : '0';
            out[o++] = '.';
            if (nd > exp10 + 1)
                for (int i = exp10 + 1; i < nd; i++) out[o++] = digits[i];
            else
                out[o++] = '0';
        }
        out[o] = '\0';
    } else { /* scientific: d[.ddd]e[+-]XX with at least two exponent digits */
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (int i = 1; i < nd; i++) out[o++] = digits[i];
        }
        o +=
            snprintf(out + o, sizeof out - (size_t)o, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
    return (size_t)snprintf(buf, n, "%s", out);
}

size_t pd_fmt_go_float(double v, char *buf, size_t n)
{
    if (isinf(v)) return (size_t)snprintf(buf, n, v > 0 ? "+Inf" : "-Inf");
    if (isnan(v)) return (size_t)snprintf(buf, n, "NaN");
    char s[64];
    pd_fmt_double(v, s, sizeof s);
    const char *dot = strchr(s, '.');
    if (v > 0 && dot && dot - s > 6) { /* 1234567.0 -> 1.234567e+06 */
        int int_digits = (int)(dot - s);
        char mant[64];
        int m = 0;
        mant[m++] = s[0];
        mant[m++] = '.';
        for (int i = 1; i < int_digits; i++) mant[m++] = s[i];
        mant[m] = '\0';
        while (m > 0 && (mant[m - 1] == '0' || mant[m - 1] == '.')) mant[--m] = '\0';
        return (size_t)snprintf(buf, n, "%se+0%d", mant, int_digits - 1);
    }
    return (size_t)snprintf(buf, n, "%s", s);
}

size_t pd_str_copy(char *dst, size_t n, const char *src)
{
    size_t len = src ? strlen(src) : 0;
    if (len >= n) {
        len = n - 1;
        while (len > 0 && ((unsigned char)src[len] & 0xC0) == 0x80) len--; /* continuation */
    }
    if (len) memcpy(dst, src, len);
    dst[len] = '\0';
    return len;
}
