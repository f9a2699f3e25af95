/* acc_error.c: thread-local error text for acc_status returns, and dtype names.
 * Not for: Python exceptions (bind_util.c does that). */
#include <stdarg.h>
#include <stdio.h>

#include "acc.h"

static _Thread_local char acc_errbuf[512];

void acc_set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(acc_errbuf, sizeof acc_errbuf, fmt, ap);
    va_end(ap);
}

const char *acc_last_error(void) { return acc_errbuf; }

const char *acc_dtype_name(acc_dtype t) {
    static const char *names[ACC_NDTYPES] = {"float32", "bfloat16", "float16", "float64", "float8_e4m3fn",
                                             "float8_e5m2", "int64", "int32", "uint8", "int8", "bool", "int16"};
    return (t >= 0 && t < ACC_NDTYPES) ? names[t] : "unknown";
}
