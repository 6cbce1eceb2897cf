/* libmtmd's side of skippy's cffi extension: compiled after llama_helpers.c, in the same translation unit. */
#include "mtmd.h"
#include "mtmd-helper.h"

/* stb_image's, exported by libmtmd (its helper compiles stb_image in); stb_image.h itself is not installed */
int stbi_info_from_memory(const unsigned char * buffer, int len, int * x, int * y, int * comp);

/* libmtmd (and its helpers) log through their own callback: route it to llama.cpp's, so that an error line is
 * kept for our exceptions and the rest stays quiet unless SKIPPY_LLAMA_LOG=1. */
void skippy_mtmd_log_setup(void) {
    mtmd_helper_log_set(skippy_log_cb, NULL);
}
