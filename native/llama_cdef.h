/* The subset of llama.h that skippy uses, for cffi in API mode.
 *
 * Structs are declared partially ("...;"): the C compiler fills in the real
 * layout from the patched llama.h, so upstream field additions cannot silently
 * shift offsets. Only the fields we touch are named here.
 */

typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;

struct llama_model;
struct llama_context;
struct llama_vocab;
struct llama_sampler;
struct llama_memory_i;
struct ggml_threadpool;
typedef struct llama_memory_i * llama_memory_t;

#define LLAMA_DEFAULT_SEED ...

/* M-RoPE (and its interleaved form) take several positions per embedding row: llama.cpp's n_pos_per_embd */
enum llama_rope_type { LLAMA_ROPE_TYPE_MROPE, LLAMA_ROPE_TYPE_IMROPE, ... };
enum llama_pooling_type { LLAMA_POOLING_TYPE_UNSPECIFIED, LLAMA_POOLING_TYPE_NONE, ... };
enum llama_flash_attn_type { LLAMA_FLASH_ATTN_TYPE_AUTO, LLAMA_FLASH_ATTN_TYPE_DISABLED,
                             LLAMA_FLASH_ATTN_TYPE_ENABLED, ... };

typedef bool (*llama_progress_callback)(float progress, void * user_data);

/* ggml's backends and their devices: the CPU always, a GPU backend's devices where the build has one */
struct ggml_backend_device;
typedef struct ggml_backend_device * ggml_backend_dev_t;
struct ggml_backend_reg;
typedef struct ggml_backend_reg * ggml_backend_reg_t;
enum ggml_backend_dev_type { GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU,
                             GGML_BACKEND_DEVICE_TYPE_IGPU, GGML_BACKEND_DEVICE_TYPE_ACCEL, ... };
size_t ggml_backend_reg_count(void);
ggml_backend_reg_t ggml_backend_reg_get(size_t index);
const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);

struct llama_model_params {
    ggml_backend_dev_t * devices;  /* NULL-terminated; NULL: every GPU device */
    int32_t n_gpu_layers;
    llama_progress_callback progress_callback;
    void * progress_callback_user_data;
    bool vocab_only;
    ...;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_pooling_type pooling_type;
    enum llama_flash_attn_type flash_attn_type;
    bool embeddings;
    bool no_perf;
    bool kv_unified;
    ...;
};

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

typedef struct llama_chat_message { const char * role; const char * content; } llama_chat_message;
typedef struct llama_logit_bias { llama_token token; float bias; } llama_logit_bias;
/* whole, not partial: a guided sampler builds its candidates as a numpy array of this layout */
typedef struct llama_token_data { llama_token id; float logit; float p; } llama_token_data;
typedef struct llama_token_data_array { llama_token_data * data; size_t size; int64_t selected; bool sorted; ...; }
    llama_token_data_array;
typedef struct llama_sampler_chain_params { bool no_perf; ...; } llama_sampler_chain_params;

void llama_backend_init(void);
const char * llama_print_system_info(void);
struct llama_model_params   llama_model_default_params(void);
struct llama_context_params llama_context_default_params(void);
struct llama_sampler_chain_params llama_sampler_chain_default_params(void);

struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);

const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
int32_t llama_model_n_embd_inp(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
enum llama_rope_type llama_model_rope_type(const struct llama_model * model);
uint64_t llama_model_size(const struct llama_model * model);
int32_t llama_model_n_head(const struct llama_model * model);
int32_t llama_model_n_head_kv(const struct llama_model * model);
int32_t llama_model_n_swa(const struct llama_model * model);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);

uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
uint32_t llama_n_batch(const struct llama_context * ctx);
uint32_t llama_n_ubatch(const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);

int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
llama_token llama_vocab_eot(const struct llama_vocab * vocab);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);

struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
void llama_set_causal_attn(struct llama_context * ctx, bool causal_attn);
void llama_attach_threadpool(struct llama_context * ctx, struct ggml_threadpool * threadpool,
                             struct ggml_threadpool * threadpool_batch);
void llama_detach_threadpool(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
float * llama_get_embeddings(struct llama_context * ctx);

llama_memory_t llama_get_memory(const struct llama_context * ctx);
void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);

size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);

struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n, float penalty_repeat,
                                                    float penalty_freq, float penalty_present);
struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
                                                     const llama_logit_bias * logit_bias);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
void llama_sampler_reset(struct llama_sampler * smpl);
void llama_sampler_free(struct llama_sampler * smpl);

/* Our C helpers (native/llama_helpers.c) */
struct ggml_threadpool * skippy_threadpool_new(int n_threads, int poll);
void skippy_threadpool_free(struct ggml_threadpool * threadpool);
struct skippy_warm;
struct skippy_warm * skippy_warm_new(int n);
void skippy_warm_touch(struct skippy_warm * w, int64_t ns);
void skippy_warm_hold(struct skippy_warm * w);
int64_t skippy_warm_spun_ns(struct skippy_warm * w);
void skippy_warm_free(struct skippy_warm * w);
void skippy_log_setup(int verbose);
const char * skippy_last_error(void);
void skippy_clear_last_error(void);
bool skippy_progress_quiet(float progress, void * user_data);
int32_t skippy_decode_row(struct llama_context * ctx, struct llama_batch * b, llama_token token,
                          const float * embd, int32_t n_embd, llama_pos pos, llama_seq_id seq);
int32_t skippy_decode_row_send(struct llama_context * ctx, struct llama_batch * b, llama_token token,
                               const float * embd, int32_t n_embd, llama_pos pos, llama_seq_id seq,
                               uint8_t * frame, int64_t head_len, int64_t frame_len, int32_t half, int lock_fd,
                               int fd, int64_t * sent, int64_t * done_ns);
int32_t skippy_decode_row_sample_send(struct llama_context * ctx, struct llama_batch * b, llama_token token,
                                      const float * embd, int32_t n_embd, llama_pos pos, llama_seq_id seq,
                                      struct llama_sampler * smpl, uint8_t * frame, int64_t frame_len,
                                      int64_t us_at, int lock_fd, int fd, int64_t * sent, int64_t * done_ns,
                                      llama_token * out_token);
int skippy_fill_token_batch(struct llama_batch * b, const llama_token * tok, int32_t n_tokens,
                            const llama_pos * pos, const llama_seq_id * seq, const int8_t * out);
int skippy_fill_embd_batch(struct llama_batch * b, const float * embd, int32_t n_tokens, int32_t n_embd,
                           const llama_pos * pos, const llama_seq_id * seq, const int8_t * out);
int skippy_sample_rows(struct llama_context * ctx, struct llama_sampler ** samplers, const int32_t * rows,
                       int32_t n, llama_token * out_tokens);
int64_t skippy_vocab_pieces(const struct llama_vocab * vocab, int32_t n_vocab, char * buf, int64_t cap,
                            int64_t * offsets, uint8_t * control);
int32_t skippy_vocab_eog(const struct llama_vocab * vocab, int32_t n_vocab, llama_token * out);
