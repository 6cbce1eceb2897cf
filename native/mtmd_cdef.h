/* The subset of libmtmd (llama.cpp's tools/mtmd: mtmd.h, mtmd-helper.h) that skippy's head uses, for cffi in
 * API mode, compiled into the same extension as llama_cdef.h. Structs are partial ("...;") as there. */

enum mtmd_input_chunk_type { MTMD_INPUT_CHUNK_TYPE_TEXT, MTMD_INPUT_CHUNK_TYPE_IMAGE, MTMD_INPUT_CHUNK_TYPE_AUDIO,
                             ... };

typedef struct mtmd_context      mtmd_context;
typedef struct mtmd_bitmap       mtmd_bitmap;
typedef struct mtmd_image_tokens mtmd_image_tokens;
typedef struct mtmd_input_chunk  mtmd_input_chunk;
typedef struct mtmd_input_chunks mtmd_input_chunks;
typedef struct mtmd_helper_video mtmd_helper_video;

struct mtmd_input_text {
    const char * text;
    size_t text_len;
    bool add_special;
    bool parse_special;
    ...;
};
typedef struct mtmd_input_text mtmd_input_text;

struct mtmd_context_params {
    bool use_gpu;
    bool print_timings;
    int n_threads;
    const char * media_marker;
    bool warmup;
    int image_min_tokens;
    int image_max_tokens;
    ...;
};

struct mtmd_decoder_pos { uint32_t t; uint32_t x; uint32_t y; uint32_t z; ...; };

struct mtmd_helper_init_opt { ...; };
struct mtmd_helper_bitmap_wrapper { mtmd_bitmap * bitmap; mtmd_helper_video * video_ctx; ...; };

const char * mtmd_default_marker(void);
struct mtmd_context_params mtmd_context_params_default(void);
mtmd_context * mtmd_init_from_file(const char * mmproj_fname, const struct llama_model * text_model,
                                   const struct mtmd_context_params ctx_params);
void mtmd_free(mtmd_context * ctx);
bool mtmd_decode_use_non_causal(const mtmd_context * ctx, const mtmd_input_chunk * chunk);
bool mtmd_decode_use_mrope(const mtmd_context * ctx);
bool mtmd_support_vision(const mtmd_context * ctx);
bool mtmd_support_audio(const mtmd_context * ctx);
const char * mtmd_get_marker(const mtmd_context * ctx);

mtmd_bitmap * mtmd_bitmap_init(uint32_t nx, uint32_t ny, const unsigned char * data);
uint32_t mtmd_bitmap_get_nx(const mtmd_bitmap * bitmap);
uint32_t mtmd_bitmap_get_ny(const mtmd_bitmap * bitmap);
size_t mtmd_bitmap_get_n_bytes(const mtmd_bitmap * bitmap);
const unsigned char * mtmd_bitmap_get_data(const mtmd_bitmap * bitmap);
bool mtmd_bitmap_is_audio(const mtmd_bitmap * bitmap);
void mtmd_bitmap_free(mtmd_bitmap * bitmap);
const char * mtmd_bitmap_get_id(const mtmd_bitmap * bitmap);
void mtmd_bitmap_set_id(mtmd_bitmap * bitmap, const char * id);

mtmd_input_chunks * mtmd_input_chunks_init(void);
size_t mtmd_input_chunks_size(const mtmd_input_chunks * chunks);
const mtmd_input_chunk * mtmd_input_chunks_get(const mtmd_input_chunks * chunks, size_t idx);
void mtmd_input_chunks_free(mtmd_input_chunks * chunks);

enum mtmd_input_chunk_type mtmd_input_chunk_get_type(const mtmd_input_chunk * chunk);
const llama_token * mtmd_input_chunk_get_tokens_text(const mtmd_input_chunk * chunk, size_t * n_tokens_output);
const mtmd_image_tokens * mtmd_input_chunk_get_tokens_image(const mtmd_input_chunk * chunk);
size_t mtmd_input_chunk_get_n_tokens(const mtmd_input_chunk * chunk);
const char * mtmd_input_chunk_get_id(const mtmd_input_chunk * chunk);
llama_pos mtmd_input_chunk_get_n_pos(const mtmd_input_chunk * chunk);
mtmd_input_chunk * mtmd_input_chunk_copy(const mtmd_input_chunk * chunk);
void mtmd_input_chunk_free(mtmd_input_chunk * chunk);
struct mtmd_decoder_pos mtmd_image_tokens_get_decoder_pos(const mtmd_image_tokens * image_tokens, llama_pos pos_0,
                                                          size_t i);

int32_t mtmd_tokenize(const mtmd_context * ctx, mtmd_input_chunks * output, const mtmd_input_text * text,
                      const mtmd_bitmap * const * bitmaps, size_t n_bitmaps);
int32_t mtmd_encode_chunk(mtmd_context * ctx, const mtmd_input_chunk * chunk);
float * mtmd_get_output_embd(mtmd_context * ctx);

struct mtmd_helper_init_opt mtmd_helper_init_opt_default(void);
struct mtmd_helper_bitmap_wrapper mtmd_helper_bitmap_init_from_buf(const mtmd_context * ctx, const unsigned char * buf,
                                                                   size_t len, bool placeholder,
                                                                   struct mtmd_helper_init_opt opt);

/* stb_image (compiled into libmtmd by its helper): an image's size and channels from its header alone, nothing
 * decoded; 0 for data it cannot read */
int stbi_info_from_memory(const unsigned char * buffer, int len, int * x, int * y, int * comp);

/* Our C helpers (native/mtmd_helpers.c) */
void skippy_mtmd_log_setup(void);
