/* Small C helpers compiled into skippy's cffi extension.
 * They exist to keep per-token loops out of Python and to handle llama.cpp's
 * logging without a Python callback on a C thread. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <time.h>
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

int skippy_sample_rows(struct llama_context * ctx, struct llama_sampler ** samplers, const int32_t * rows,
                       int32_t n, llama_token * out_tokens);

static int64_t skippy_now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t) now.tv_sec * 1000000000 + now.tv_nsec;
}

static void skippy_put_le(uint8_t * p, uint64_t v, int n_bytes) {  /* the wire's integers are little-endian */
    for (int i = 0; i < n_bytes; ++i) p[i] = (uint8_t) (v >> (8 * i));
}

/* The end of both calls below: release the lock, write the frame (if the compute succeeded). */
static void skippy_release_and_send(int32_t rc, const uint8_t * frame, int64_t frame_len, int lock_fd, int fd,
                                    int64_t * sent) {
    if (lock_fd >= 0) flock(lock_fd, LOCK_UN);
    *sent = 0;
    if (rc == 0 && fd >= 0) {
        ssize_t n = send(fd, frame, (size_t) frame_len, MSG_DONTWAIT | MSG_NOSIGNAL);
        *sent = n >= 0 ? (int64_t) n : (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -errno);
    }
}

/* The largest finite half float: a row with a larger value (or a NaN) cannot travel as half floats. */
#define SKIPPY_HALF_MAX 65504.0f

/* `n` floats as little-endian half floats into `out` (unaligned): 0, or -1 (nothing usable written) if a
 * value is beyond half's range or not a number. */
static int skippy_to_half(const float * x, uint8_t * out, int64_t n) {
    float top = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        const float a = fabsf(x[i]);
        top = a > top || a != a ? a : top;  /* a NaN sticks */
    }
    if (!(top <= SKIPPY_HALF_MAX)) return -1;
    ggml_fp16_t * y = (ggml_fp16_t *) out;
    if (((uintptr_t) out & 1) == 0) {
        ggml_fp32_to_fp16_row(x, y, n);
    } else {
        for (int64_t i = 0; i < n; ++i) {
            const ggml_fp16_t h = ggml_fp32_to_fp16(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
    }
    return 0;
}

/* A decode step whose frame leaves from here the moment the compute ends, not after the Python that follows
 * it (~0.2 ms after a compute, caches cold): the row's hidden state is copied into `frame` after its first
 * `head_len` bytes (as half floats with `half`: the frame then has 2 bytes a value), the host's compute lock
 * is released (`lock_fd`, -1: none; released whatever the result), and the frame is written to the socket
 * `fd` without blocking (-1: not written, the caller hands it on). *sent: the bytes written (0 if the socket
 * took none, -errno if it failed); *done_ns: CLOCK_MONOTONIC at the compute's end, or 0 if the row did not
 * fit half floats (nothing written: the caller sends the row as float32). Returns llama_decode's result,
 * -100 as skippy_decode_row, -101 without hidden states. */
int32_t skippy_decode_row_send(struct llama_context * ctx, struct llama_batch * b, llama_token token,
                               const float * embd, int32_t n_embd, llama_pos pos, llama_seq_id seq,
                               uint8_t * frame, int64_t head_len, int64_t frame_len, int32_t half, int lock_fd,
                               int fd, int64_t * sent, int64_t * done_ns) {
    int32_t rc = skippy_decode_row(ctx, b, token, embd, n_embd, pos, seq);
    int fits = 1;
    if (rc == 0) {
        const float * hidden = llama_get_embeddings(ctx);
        if (hidden == NULL) rc = -101;
        else if (half) fits = skippy_to_half(hidden, frame + head_len, (frame_len - head_len) / 2) == 0;
        else memcpy(frame + head_len, hidden, (size_t) (frame_len - head_len));
    }
    if (!fits) {
        if (lock_fd >= 0) flock(lock_fd, LOCK_UN);
        *sent = 0;
        *done_ns = 0;
        return rc;
    }
    *done_ns = skippy_now_ns();
    skippy_release_and_send(rc, frame, frame_len, lock_fd, fd, sent);
    return rc;
}

/* The final stage's twin of skippy_decode_row_send: the row's token is sampled (`smpl`; NULL: greedy) into
 * *out_token and the frame's last 4 bytes (a one-token reply's), the compute's microseconds (decode and
 * sampling) into the two u64 at `us_at` (a reply's compute_us and compute_us_max); then the same release and
 * write. -102: no logits to sample. */
int32_t skippy_decode_row_sample_send(struct llama_context * ctx, struct llama_batch * b, llama_token token,
                                      const float * embd, int32_t n_embd, llama_pos pos, llama_seq_id seq,
                                      struct llama_sampler * smpl, uint8_t * frame, int64_t frame_len,
                                      int64_t us_at, int lock_fd, int fd, int64_t * sent, int64_t * done_ns,
                                      llama_token * out_token) {
    const int64_t started = skippy_now_ns();
    int32_t rc = skippy_decode_row(ctx, b, token, embd, n_embd, pos, seq);
    const int32_t row = 0;  /* the batch's only row */
    if (rc == 0 && skippy_sample_rows(ctx, &smpl, &row, 1, out_token) != 0) rc = -102;
    *done_ns = skippy_now_ns();
    if (rc == 0) {
        const uint64_t us = (uint64_t) ((*done_ns - started) / 1000);
        skippy_put_le(frame + frame_len - 4, (uint32_t) *out_token, 4);
        skippy_put_le(frame + us_at, us, 8);
        skippy_put_le(frame + us_at + 8, us, 8);
    }
    skippy_release_and_send(rc, frame, frame_len, lock_fd, fd, sent);
    return rc;
}

/* The first index of the largest value (NaN never wins): the largest value first, kept in SKIPPY_LANES
 * independent maxima (no chain from one element to the next; the compiler makes them one vector), then its
 * first index. A one-pass loop that compares with logits[best] chains a load and a compare through `best`
 * per element, several times slower over a large vocabulary. */
#define SKIPPY_LANES 16
static int32_t skippy_argmax(const float * logits, int32_t n) {
    float top = logits[0];
    int32_t t = 0;
    if (n >= SKIPPY_LANES) {
        float lane[SKIPPY_LANES];
        for (int j = 0; j < SKIPPY_LANES; ++j) lane[j] = top;  /* (a NaN in a lane would hide its others) */
        for (; t + SKIPPY_LANES <= n; t += SKIPPY_LANES) {
            for (int j = 0; j < SKIPPY_LANES; ++j) lane[j] = logits[t + j] > lane[j] ? logits[t + j] : lane[j];
        }
        for (int j = 0; j < SKIPPY_LANES; ++j) top = lane[j] > top ? lane[j] : top;
    }
    for (; t < n; ++t) top = logits[t] > top ? logits[t] : top;
    for (t = 0; t < n; ++t) {
        if (logits[t] == top) return t;
    }
    return 0;  /* top is NaN: logits[0] was (the one-pass loop's answer too) */
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
            out_tokens[i] = skippy_argmax(logits, n_vocab);
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

/* Keep warm: threads that spin, at the lowest scheduling class (SCHED_IDLE: they run on cores that nothing
 * else wants, and any other thread that wakes takes the core at once), for a while after each compute. A
 * stage waiting for its next step would otherwise leave its cores idle, and a core that went idle for
 * milliseconds (a halted vCPU, a deep C-state, a lowered clock) computes the next step up to twice as slowly.
 * This is what llama.cpp's own --poll does for its workers, without taking cores from other threads. */
struct skippy_warm {
    /* start-up only. touch() and hold() take no lock: a SCHED_IDLE thread preempted while it held one would
     * hold up the compute thread that wants it for milliseconds */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic int64_t until_ns;  /* CLOCK_MONOTONIC: spin until then */
    _Atomic int64_t spun_ns;   /* time the threads have spun, all together (for tests and status) */
    _Atomic uint32_t seq;      /* the futex sleeping threads wait on: bumped by every touch */
    _Atomic int sleeping;
    _Atomic int stop;
    int n, started, failed;  /* threads created; of them, at their class so far; could not take it (errno) */
    pthread_t threads[];
};

static inline void skippy_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static void * skippy_warm_main(void * arg) {
    struct skippy_warm * w = arg;
    /* glibc creates threads at SCHED_OTHER/FIFO/RR only: each thread takes SCHED_IDLE itself, first thing */
    struct sched_param param = {0};
    int rc = pthread_setschedparam(pthread_self(), SCHED_IDLE, &param);
    pthread_mutex_lock(&w->mu);
    w->started++;
    if (rc != 0) {
        w->failed = rc;
        atomic_store(&w->stop, 1);
    }
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    while (!atomic_load(&w->stop)) {
        int64_t now = skippy_now_ns();
        if (now < atomic_load(&w->until_ns)) {
            int64_t started = now;
            while (!atomic_load_explicit(&w->stop, memory_order_relaxed) && now < atomic_load(&w->until_ns)) {
                for (int i = 0; i < 32; i++) skippy_cpu_relax();
                now = skippy_now_ns();
            }
            atomic_fetch_add(&w->spun_ns, now - started);
            continue;
        }
        /* asleep until a touch: announced before the deadline is read again, as touch() stores the deadline
         * before it reads the count (both seq_cst), so a touch either is seen here or wakes this thread */
        uint32_t seq = atomic_load(&w->seq);
        atomic_fetch_add(&w->sleeping, 1);
        if (!atomic_load(&w->stop) && skippy_now_ns() >= atomic_load(&w->until_ns))
            syscall(SYS_futex, &w->seq, FUTEX_WAIT_PRIVATE, seq, NULL, NULL, 0);  /* EAGAIN: seq moved on */
        atomic_fetch_sub(&w->sleeping, 1);
    }
    return NULL;
}

static void skippy_warm_wake(struct skippy_warm * w) {
    atomic_fetch_add(&w->seq, 1);
    if (atomic_load(&w->sleeping) > 0) syscall(SYS_futex, &w->seq, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

void skippy_warm_free(struct skippy_warm * w);

/* n spinning threads (skippy runs one: ContextParams.keep_warm_threads), asleep until the first touch. NULL,
 * with errno set, if a thread could not be created or could not take the SCHED_IDLE class (none runs at
 * another). */
struct skippy_warm * skippy_warm_new(int n) {
    if (n < 1 || n > 256) { errno = EINVAL; return NULL; }
    struct skippy_warm * w = calloc(1, sizeof *w + (size_t) n * sizeof(pthread_t));
    if (w == NULL) return NULL;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    int rc = 0;
    for (int i = 0; rc == 0 && i < n; i++) {
        rc = pthread_create(&w->threads[i], &attr, skippy_warm_main, w);
        if (rc == 0) w->n++;
    }
    pthread_attr_destroy(&attr);
    pthread_mutex_lock(&w->mu);
    while (w->started < w->n) pthread_cond_wait(&w->cv, &w->mu);  /* every thread at SCHED_IDLE, or failed */
    if (rc == 0) rc = w->failed;
    pthread_mutex_unlock(&w->mu);
    if (rc != 0) {
        skippy_warm_free(w);
        errno = rc;
        return NULL;
    }
    return w;
}

/* After a compute: spin from now until ns from now. Lock-free, as hold(): they run around every compute. */
void skippy_warm_touch(struct skippy_warm * w, int64_t ns) {
    atomic_store(&w->until_ns, skippy_now_ns() + ns);
    skippy_warm_wake(w);
}

/* Before a compute: the threads stop spinning (within microseconds) and sleep until the next touch. SCHED_IDLE
 * threads still take a core now and then from a busy thread (the scheduler's minimum share), and a compute
 * thread that loses its core for a moment holds up its peers at the next barrier. */
void skippy_warm_hold(struct skippy_warm * w) { atomic_store(&w->until_ns, 0); }

int64_t skippy_warm_spun_ns(struct skippy_warm * w) { return atomic_load(&w->spun_ns); }

void skippy_warm_free(struct skippy_warm * w) {
    if (w == NULL) return;
    atomic_store(&w->stop, 1);
    skippy_warm_wake(w);
    for (int i = 0; i < w->n; i++) pthread_join(w->threads[i], NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
}

/* The whole vocabulary's pieces in one call (llguidance's view of it, made once per model): token t's bytes
 * (special tokens shown) at buf[offsets[t] .. offsets[t + 1]), and control[t] = 1 for a token that shows
 * only as special (empty otherwise). Returns the bytes all pieces take: more than cap means buf was too
 * small (call again with that much room). */
int64_t skippy_vocab_pieces(const struct llama_vocab * vocab, int32_t n_vocab, char * buf, int64_t cap,
                            int64_t * offsets, uint8_t * control) {
    char probe[256];
    int64_t pos = 0;
    for (int32_t t = 0; t < n_vocab; ++t) {
        offsets[t] = pos;
        int64_t room = cap - pos;
        int32_t n = room > 0 ? llama_token_to_piece(vocab, t, buf + pos, room > INT32_MAX ? INT32_MAX : (int32_t) room,
                                                    0, true)
                             : llama_token_to_piece(vocab, t, probe, 0, 0, true);
        if (n < 0) n = -n;  /* it does not fit: counted, not written */
        int32_t plain = n == 0 ? 0 : llama_token_to_piece(vocab, t, probe, (int32_t) sizeof probe, 0, false);
        control[t] = (uint8_t) (n > 0 && plain == 0);
        pos += n;
    }
    offsets[n_vocab] = pos;
    return pos;
}

/* The end-of-generation tokens of the vocabulary into out (room for n_vocab); returns how many. */
int32_t skippy_vocab_eog(const struct llama_vocab * vocab, int32_t n_vocab, llama_token * out) {
    int32_t k = 0;
    for (int32_t t = 0; t < n_vocab; ++t) {
        if (llama_vocab_is_eog(vocab, t)) out[k++] = t;
    }
    return k;
}
