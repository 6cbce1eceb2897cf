/* Small C helpers compiled into skippy's cffi extension.
 * They exist to keep per-token loops out of Python and to handle llama.cpp's
 * logging without a Python callback on a C thread. */
#include <stdio.h>
#include <string.h>
#include "llama.h"
#include "ggml-cpu.h"

static int skippy_log_verbose = 0;
/* The last error-level line llama.cpp logged on this thread: folded into our
 * Python exceptions so that "failed to load model" says why. */
static _Thread_local char skippy_last_error_buf[1024];

static void skippy_log_cb(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level == GGML_LOG_LEVEL_ERROR) {
        size_t n = strlen(text);
        if (n >= sizeof skippy_last_error_buf) n = sizeof skippy_last_error_buf - 1;
        memcpy(skippy_last_error_buf, text, n);
        while (n > 0 && (skippy_last_error_buf[n - 1] == '\n' || skippy_last_error_buf[n - 1] == ' ')) n--;
        skippy_last_error_buf[n] = '\0';
    }
    if (skippy_log_verbose || level == GGML_LOG_LEVEL_ERROR) {
        if (skippy_log_verbose || text[0] != '\0') fputs(text, stderr);
    }
}

void skippy_log_setup(int verbose) {
    skippy_log_verbose = verbose;
    llama_log_set(skippy_log_cb, NULL);
}

const char * skippy_last_error(void) { return skippy_last_error_buf; }
void skippy_clear_last_error(void) { skippy_last_error_buf[0] = '\0'; }

bool skippy_progress_quiet(float progress, void * user_data) {
    (void) progress; (void) user_data;
    return true;
}

static void skippy_fill_common(struct llama_batch * b, int32_t n_tokens, const llama_pos * pos,
                               const llama_seq_id * seq, const int8_t * out) {
    b->n_tokens = n_tokens;
    memcpy(b->pos, pos, sizeof(llama_pos) * (size_t) n_tokens);
    for (int32_t i = 0; i < n_tokens; ++i) {
        b->n_seq_id[i] = 1;
        b->seq_id[i][0] = seq[i];
        b->logits[i] = out[i];
    }
}

int skippy_fill_token_batch(struct llama_batch * b, const llama_token * tok, int32_t n_tokens,
                            const llama_pos * pos, const llama_seq_id * seq, const int8_t * out) {
    if (b->token == NULL) return -1;
    memcpy(b->token, tok, sizeof(llama_token) * (size_t) n_tokens);
    skippy_fill_common(b, n_tokens, pos, seq, out);
    return 0;
}

int skippy_fill_embd_batch(struct llama_batch * b, const float * embd, int32_t n_tokens, int32_t n_embd,
                           const llama_pos * pos, const llama_seq_id * seq, const int8_t * out) {
    if (b->embd == NULL) return -1;
    memcpy(b->embd, embd, sizeof(float) * (size_t) n_tokens * (size_t) n_embd);
    skippy_fill_common(b, n_tokens, pos, seq, out);
    return 0;
}

/* One row for one sequence (a decode step: a token on the first stage, else a hidden state), with output,
 * filled as the general batches are and decoded: the per-token call, without the arrays a general batch
 * needs built on the Python side. -100: the batch has no room for this input kind. */
int32_t skippy_decode_row(struct llama_context * ctx, struct llama_batch * b, llama_token token,
                          const float * embd, int32_t n_embd, llama_pos pos, llama_seq_id seq) {
    const int8_t out = 1;
    int rc = embd != NULL ? skippy_fill_embd_batch(b, embd, 1, n_embd, &pos, &seq, &out)
                          : skippy_fill_token_batch(b, &token, 1, &pos, &seq, &out);
    if (rc != 0) return -100;
    return llama_decode(ctx, *b);
}

/* Sample one token per output row with that row's sampler (a NULL sampler means greedy argmax). */
int skippy_sample_rows(struct llama_context * ctx, struct llama_sampler ** samplers, const int32_t * rows,
                       int32_t n, llama_token * out_tokens) {
    const struct llama_model * model = llama_get_model(ctx);
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int32_t i = 0; i < n; ++i) {
        if (samplers[i] != NULL) {
            out_tokens[i] = llama_sampler_sample(samplers[i], ctx, rows[i]);
        } else {
            const float * logits = llama_get_logits_ith(ctx, rows[i]);
            if (logits == NULL) return -1;
            int32_t best = 0;
            for (int32_t t = 1; t < n_vocab; ++t) {
                if (logits[t] > logits[best]) best = t;
            }
            out_tokens[i] = best;
        }
    }
    return 0;
}

/* A persistent ggml thread pool. Without one, ggml creates and joins its worker
 * threads for every graph; with poll = 0 the workers sleep between graphs
 * instead of spinning, which matters when other stages share the cores. */
struct ggml_threadpool * skippy_threadpool_new(int n_threads, int poll) {
    struct ggml_threadpool_params params = ggml_threadpool_params_default(n_threads);
    params.poll = (uint32_t) poll;
    return ggml_threadpool_new(&params);
}

void skippy_threadpool_free(struct ggml_threadpool * threadpool) {
    if (threadpool != NULL) ggml_threadpool_free(threadpool);
}
