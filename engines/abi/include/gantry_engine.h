/*
 * gantry_engine.h — the Gantry engine plugin ABI, version 1.10.
 *
 * This header is the contract between the Gantry engine host (inside
 * `gantry-node`) and an engine plugin (a shared library that runs models).
 * It is pure C99 and is the single source of truth: the Rust mirrors in
 * `engines/abi/src/ffi.rs` are checked against it by a test.
 *
 * COMPATIBILITY POLICY
 *   - A plugin exports exactly one symbol, `gantry_engine_entry`, returning a
 *     pointer to a static `gantry_engine_entry_t` = {abi_major, abi_minor,
 *     struct_size, vtable}.
 *   - The host calls `gantry_engine_entry` first and nothing else until it has
 *     checked `abi_major`. A plugin whose major differs from the host's
 *     `GANTRY_ABI_MAJOR` is refused ("ABI version mismatch: expected X, got Y")
 *     without calling any other function.
 *   - Minor versions are backwards compatible. New functions are only ever
 *     APPENDED to the end of `gantry_engine_vtable_t`; new fields are only ever
 *     APPENDED to the end of structs that carry a leading `struct_size`.
 *     A host reads a vtable slot only when `vtable->struct_size` covers it, and
 *     a plugin reads a struct field only when that struct's `struct_size` covers
 *     it. Nothing is ever removed or reordered within a major version.
 *   - Out structs the host allocates (`gantry_engine_info_t`,
 *     `gantry_model_info_t`): the host sets `struct_size` to the size it
 *     allocated before the call; the plugin writes at most that many bytes and
 *     sets `struct_size` to the size it wrote, so a newer plugin never writes
 *     past an older host's struct, and fields it did not write keep the host's
 *     defaults (since 1.2; 1.0 and 1.1 plugins wrote their whole struct, which
 *     was never larger than the host's).
 *   - Enum values are fixed forever once published; the status codes below are
 *     exactly the ten codes of the Gantry engine specification.
 *
 * OWNERSHIP AND LIFETIMES (the rule for every function below)
 *   - Memory is freed by whoever allocated it. The host never frees plugin
 *     memory and the plugin never frees host memory.
 *   - Pointers passed INTO a function (`const` inputs) are owned by the host
 *     and valid only for the duration of that call; copy what you keep.
 *   - Output buffers (`out`, `*_buf`, `err`) are allocated by the host with the
 *     capacity given; the plugin writes at most that much.
 *   - Strings returned BY the plugin inside `gantry_engine_info_t` live until
 *     the library is unloaded; inside `gantry_model_info_t` they live until
 *     that model is unloaded.
 *   - Handles (`gantry_engine_t*`, `gantry_model_t*`) are opaque, allocated by
 *     the plugin in `create` / `load_model` and released by the host exactly
 *     once through `destroy` / `unload_model`.
 *
 * THREADING
 *   - `create`, `destroy`, `load_model` and `unload_model` on one engine are
 *     serialized by the host.
 *   - `seq_open`, `seq_release`, `step`, `embed`, `seq_cached_tokens`, `seq_fork`,
 *     `seq_truncate`, `adapter_load`, `adapter_unload`, `seq_set_adapter`,
 *     `embed_batch`, `seq_set_input`, `speech_open`, `speech_next` and
 *     `speech_close` on one model are never called concurrently with each other (the host's scheduler
 *     owns them), but
 *     different models may be stepped concurrently from different threads.
 *   - `model_info`, `tokenize` and `detokenize` may be called from any thread
 *     at any time while the model is loaded, concurrently with `step`.
 *   - The log callback may be invoked from any plugin thread.
 *
 * ERRORS
 *   Every fallible function returns a `gantry_status_t` and takes a
 *   `gantry_error_t* err` (never NULL). On a non-OK status the plugin writes a
 *   NUL-terminated, human-readable message into `err->message` (truncated to
 *   GANTRY_ERROR_MESSAGE_MAX - 1 bytes). A plugin must never unwind (C++
 *   exception, Rust panic) across this boundary: it catches and returns
 *   GANTRY_INTERNAL with the message instead.
 */
#ifndef GANTRY_ENGINE_H
#define GANTRY_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GANTRY_ABI_MAJOR 1
#define GANTRY_ABI_MINOR 12

/* Name of the one exported symbol. */
#define GANTRY_ENGINE_ENTRY_SYMBOL "gantry_engine_entry"

/* Capacity of the message buffer in gantry_error_t, including the NUL. */
#define GANTRY_ERROR_MESSAGE_MAX 1024
/* Most alternatives step can return per sampled token (OpenAI's limit). */
#define GANTRY_MAX_TOP_LOGPROBS 20

/* ---- status codes (HTTP mapping is the host's, documented in docs/abi.md) ---- */
typedef int32_t gantry_status_t;
#define GANTRY_OK 0
#define GANTRY_OOM_VRAM 1
#define GANTRY_OOM_RAM 2
#define GANTRY_MODEL_CORRUPT 3
#define GANTRY_TIMEOUT 4
#define GANTRY_CANCELLED 5
#define GANTRY_UNSUPPORTED 6
#define GANTRY_INTERNAL 7
#define GANTRY_ABI_MISMATCH 8
#define GANTRY_LOAD_FAILED 9

/* ---- small enums, fixed-width on the wire ---- */
typedef uint32_t gantry_backend_t;
#define GANTRY_BACKEND_CPU 0
#define GANTRY_BACKEND_CUDA 1

typedef uint32_t gantry_format_t;
#define GANTRY_FORMAT_GGUF 0
#define GANTRY_FORMAT_SAFETENSORS 1
/* Since 1.10: an ONNX graph (`primary_file`, a `.onnx`) with its config beside it (a Piper
 * voice's `<name>.onnx.json`). */
#define GANTRY_FORMAT_ONNX 2

typedef uint32_t gantry_log_level_t;
#define GANTRY_LOG_ERROR 0
#define GANTRY_LOG_WARN 1
#define GANTRY_LOG_INFO 2
#define GANTRY_LOG_DEBUG 3

/* Bit set of what a loaded model can do. */
typedef uint32_t gantry_modality_t;
#define GANTRY_MODALITY_COMPLETION 1u
#define GANTRY_MODALITY_EMBEDDING 2u
/* Since 1.9: audio in, text out (speech recognition). The host gives each sequence its audio
 * with `seq_set_input` (GANTRY_INPUT_AUDIO) and then decodes the text with `step`, batched with
 * every other sequence of the model, as any completion. */
#define GANTRY_MODALITY_TRANSCRIPTION 4u
/* Since 1.9 declared, since 1.10 served: text in, audio out (speech synthesis), through
 * `speech_open` / `speech_next` / `speech_close`; the model lists its `voices` and produces
 * audio at its `audio_sample_rate`. */
#define GANTRY_MODALITY_SPEECH 8u
/* Since 1.9, declared: image in, text out (vision-language models), through `seq_set_input`
 * with GANTRY_INPUT_IMAGE. No engine implements it yet. */
#define GANTRY_MODALITY_VISION 16u
/* Since 1.9, declared: text in, image out (diffusion); no entry point yet. */
#define GANTRY_MODALITY_IMAGE 32u

/* Since 1.9: the kind of a `gantry_input_t`. */
typedef uint32_t gantry_input_kind_t;
/* Mono PCM, f32 samples in [-1, 1], at the model's `audio_sample_rate`. */
#define GANTRY_INPUT_AUDIO 1u
/* 8-bit RGB pixels, `width` x `height`, rows top to bottom (declared; see VISION above). */
#define GANTRY_INPUT_IMAGE 2u

/* Since 1.11: bits of `gantry_input_t.flags`. */
/* Keep, for each token fed to the sequence after this input, what `seq_token_times` needs
 * (Whisper: the cross-attention of its alignment heads). A plugin that cannot align the
 * model's tokens with its input refuses the input with GANTRY_UNSUPPORTED. */
#define GANTRY_INPUT_ALIGN 1u

/* Bit set of optional features a plugin implements (since 1.2, in
 * `gantry_engine_info_t.capabilities`). */
typedef uint32_t gantry_capability_t;
/* `step` honours `gantry_sampling_t.allowed_tokens`: a request whose output is
 * constrained (structured outputs, forced tool calls) is refused with a 400
 * naming the engine when its plugin lacks this bit, never answered unconstrained. */
#define GANTRY_CAP_TOKEN_MASK 1u
/* Since 1.5: `step` honours GANTRY_STEP_SAMPLE_ALL and `seq_truncate` is implemented, so
 * the host may verify drafted tokens (speculative decoding) in one step. */
#define GANTRY_CAP_SPECULATE 2u
/* Since 1.6: `adapter_load`, `adapter_unload` and `seq_set_adapter` are implemented, so
 * sequences of one step may each run the base model or one of its LoRA adapters. */
#define GANTRY_CAP_ADAPTERS 4u

/* ---- opaque handles, allocated by the plugin ---- */
typedef struct gantry_engine gantry_engine_t;
typedef struct gantry_model gantry_model_t;

/* Error out-parameter: allocated by the host, written by the plugin on failure. */
typedef struct gantry_error {
    char message[GANTRY_ERROR_MESSAGE_MAX];
} gantry_error_t;

/* Static description of the plugin. Strings are owned by the plugin and live
 * until the library is unloaded. */
typedef struct gantry_engine_info {
    uint32_t struct_size;
    const char* engine_id;      /* e.g. "llama_cpp"; must equal manifest.json `id` */
    const char* engine_version; /* semantic version, e.g. "0.1.0" */
    gantry_backend_t backend;   /* backend this build was compiled for */
    const char* description;    /* one line, may be NULL */
    /* Since 1.2: GANTRY_CAP_* bits; 0 when the plugin does not write it. */
    gantry_capability_t capabilities;
    /* Since 1.3: how this build uses the hardware, one line, e.g. the CPU variant
     * chosen at run time and its SIMD extensions; may be NULL. Read after `info`
     * and before `create`, so a plugin that picks its variant when the library is
     * loaded reports the variant it picked. */
    const char* build_info;
} gantry_engine_info_t;

/* Host services handed to `create`. Owned by the host; the pointer and its
 * `ctx` stay valid until `destroy` returns. */
typedef struct gantry_host_api {
    uint32_t struct_size;
    void* ctx;
    /* Log one line. `message` is NUL-terminated, valid only during the call,
     * and carries no trailing newline requirement. The host prefixes the line
     * with the plugin id. */
    void (*log)(void* ctx, gantry_log_level_t level, const char* message);
} gantry_host_api_t;

/* Engine-wide configuration, read during `create` only. */
typedef struct gantry_engine_config {
    uint32_t struct_size;
    gantry_backend_t backend;
    const int32_t* device_ids; /* n_device_ids entries; NULL when 0 */
    size_t n_device_ids;
    uint64_t vram_limit_bytes; /* 0 = no limit beyond the device */
    uint32_t n_threads;        /* 0 = plugin's choice */
    uint32_t max_batch_size;   /* most sequences open at once per model */
    uint32_t context_length;   /* default per-sequence context; 0 = model's trained length */
} gantry_engine_config_t;

/* What to load. Strings are host-owned and valid during `load_model` only. */
typedef struct gantry_model_desc {
    uint32_t struct_size;
    const char* model_id;     /* the host's name for the model */
    const char* model_dir;    /* directory holding the artifacts */
    const char* primary_file; /* absolute path of the .gguf or .safetensors index */
    gantry_format_t format;
    const char* quantization; /* e.g. "Q4_K_M"; NULL when not applicable */
    const char* mmproj;       /* absolute path of a projector; NULL when none */
    uint32_t context_length;  /* per-sequence context; 0 = config default */
    uint32_t max_sequences;   /* sequences open at once; 0 = config's max_batch_size */
    /* Since 1.3: the devices (CUDA ordinals as this process sees them) the host
     * placed this model on, first = main device; NULL/0 = the engine config's
     * devices. Engines without devices ignore it. */
    const int32_t* device_ids;
    size_t n_device_ids;
    /* Since 1.12: CPU threads for this model's work; 0 = the engine config's `n_threads`. An
     * engine that shares one pool among its models may ignore it. */
    uint32_t n_threads;
} gantry_model_desc_t;

/* Since 1.6: a LoRA adapter to load next to a model. Host-owned, valid during
 * `adapter_load` only. */
typedef struct gantry_adapter_desc {
    uint32_t struct_size;
    const char* name; /* the host's name for the adapter, for messages */
    /* A GGUF LoRA file (GANTRY_FORMAT_GGUF: `general.type` = "adapter"), or a PEFT directory
     * (GANTRY_FORMAT_SAFETENSORS: `adapter_config.json` and `adapter_model.safetensors`). */
    const char* path;
    gantry_format_t format;
    /* Multiplies the adapter's own alpha / rank; 1.0 = as trained. */
    float scale;
} gantry_adapter_desc_t;

/* Facts about a loaded model. Strings and arrays are owned by the plugin and
 * live until `unload_model`. A token id of -1 means "none". */
typedef struct gantry_model_info {
    uint32_t struct_size;
    const char* architecture;        /* e.g. "llama", "gemma3" */
    uint32_t vocab_size;
    uint32_t context_length;         /* effective per-sequence context */
    uint32_t trained_context_length; /* from the model's metadata */
    uint64_t kv_capacity_tokens;     /* KV cells shared by all open sequences */
    uint32_t max_sequences;          /* most sequences open at once */
    int32_t bos_token;
    int32_t eos_token;
    const int32_t* eog_tokens; /* every end-of-generation token (EOS, EOT, ...) */
    size_t n_eog_tokens;
    const char* bos_text; /* text of BOS, for chat templates; NULL when none */
    const char* eos_text; /* text of EOS; NULL when none */
    const char* chat_template; /* embedded Jinja template; NULL when none */
    uint64_t bytes_used;       /* weights + KV + compute buffers */
    gantry_modality_t modalities;
    uint32_t embedding_dims; /* output size of `embed`; 0 if not an embedding model */
    bool add_bos;            /* the model expects BOS prepended to prompts */
    /* Since 1.7: bytes of recurrent state (state-space or short-convolution layers) that one
     * open sequence holds whatever its length, included in `bytes_used` for every sequence
     * slot; 0 for a model with K/V only. Such a state summarises every token it took: the
     * model reuses no prefix, and the host drafts nothing for it (a verification entry's
     * rejected tokens could not be cut back). */
    uint64_t recurrent_state_bytes;
    /* Since 1.9: the sample rate `seq_set_input` takes audio at (GANTRY_MODALITY_TRANSCRIPTION;
     * the host resamples what it is given); 0 for a model without audio. */
    uint32_t audio_sample_rate;
    /* Since 1.9: the most audio samples one `seq_set_input` takes (Whisper: 30 s); the host
     * cuts longer audio into windows of at most this many and decodes each in turn. */
    uint64_t audio_max_samples;
    /* Since 1.10: the voices of a GANTRY_MODALITY_SPEECH model, names separated by '\n' (the
     * first is the default); NULL for a model without speech. A speech model's
     * `audio_sample_rate` is the rate of the audio it produces. */
    const char* voices;
} gantry_model_info_t;

/* Since 1.9: what a sequence is conditioned on (`seq_set_input`). Host-owned, valid during
 * that call only. */
typedef struct gantry_input {
    uint32_t struct_size;
    gantry_input_kind_t kind;
    /* GANTRY_INPUT_AUDIO: `n` floats. GANTRY_INPUT_IMAGE: `n` = width x height x 3 bytes. */
    const void* data;
    size_t n;
    uint32_t sample_rate; /* AUDIO: equals the model's `audio_sample_rate` */
    uint32_t width;       /* IMAGE */
    uint32_t height;      /* IMAGE */
    /* Since 1.11, read only when `struct_size` covers it: GANTRY_INPUT_* bits. 64 bits wide so
     * that it starts past the end of the 1.9 struct (whose tail padding a host may leave
     * uninitialised) and `struct_size` tells the two apart. */
    uint64_t flags;
} gantry_input_t;

/* Since 1.10: what `speech_open` synthesizes. Host-owned, valid during that call only. */
typedef struct gantry_speech_request {
    uint32_t struct_size;
    const char* text; /* UTF-8, `n_text` bytes, not NUL-terminated; never empty */
    size_t n_text;
    const char* voice; /* NUL-terminated, one of the model's `voices`; NULL: the default */
    float speed;       /* pace, 1 = the voice's own; the host keeps it within [0.25, 4] */
} gantry_speech_request_t;

/* One logit bias entry. */
typedef struct gantry_logit_bias {
    int32_t token;
    float bias; /* added to the logit; -INFINITY bans the token */
} gantry_logit_bias_t;

/* Sampling parameters. Host-owned, valid during `step` only. The host sends
 * the same parameters for a sequence on every step (except `allowed_tokens`,
 * which changes from step to step); a plugin may build its sampler state on
 * the first step and keep it until `seq_release`.
 * temperature <= 0 means greedy (argmax). */
typedef struct gantry_sampling {
    uint32_t struct_size;
    float temperature;
    float top_p;  /* 1.0 = off */
    int32_t top_k; /* 0 = off */
    float min_p;  /* 0.0 = off */
    float repetition_penalty; /* 1.0 = off */
    float presence_penalty;   /* 0.0 = off */
    float frequency_penalty;  /* 0.0 = off */
    int32_t penalty_last_n;   /* tokens considered by the penalties; -1 = whole context */
    uint64_t seed;
    const gantry_logit_bias_t* logit_bias;
    size_t n_logit_bias;
    uint32_t top_logprobs; /* alternatives wanted, 0..GANTRY_MAX_TOP_LOGPROBS */
    bool want_logprob;     /* fill `logprob` of the sampled token */
    /* Since 1.2, read only when `struct_size` covers it and the plugin declares
     * GANTRY_CAP_TOKEN_MASK. The tokens this step may sample: bit (t % 32) of
     * word t / 32 is set when token t is allowed; tokens past the last word are
     * not allowed. NULL = every token. The mask applies before the sampler
     * chain, so biases, penalties, top-k/p, temperature and logprobs all see
     * the masked distribution (a disallowed token has probability 0). The host
     * guarantees at least one allowed token. */
    const uint32_t* allowed_tokens;
    size_t n_allowed_words;
} gantry_sampling_t;

/* Flags of a step entry. */
#define GANTRY_STEP_SAMPLE 1u /* sample a token after this entry's tokens */
/* Since 1.1: evaluate every token of this entry's sequence from scratch; take no prefix from a
 * cache (a warm slot of an earlier sequence). Meaningful on a sequence's first entry; the host
 * sets it on every entry of a request that asked for reproducible sampling (`seed`), so that
 * its numbers do not depend on what an earlier request left cached. A 1.0 plugin ignores it. */
#define GANTRY_STEP_FRESH 2u
/* Since 1.5, only for plugins that declare GANTRY_CAP_SPECULATE, always with
 * GANTRY_STEP_SAMPLE: sample after EVERY token of the entry, not only after the last, as if
 * the entry had been fed one token at a time (the sample after token i sees tokens 0..=i in
 * KV). The entry then takes `n_tokens` consecutive slots of `results`, in token order; every
 * other entry takes one. The host sets it only on entries whose sampling has no penalties and
 * no `allowed_tokens` mask (a plugin may refuse those with GANTRY_UNSUPPORTED). The host then
 * keeps the leading tokens whose samples matched the drafts and drops the rest with
 * `seq_truncate`; each sample draws from the sequence's generator as any sample does. */
#define GANTRY_STEP_SAMPLE_ALL 4u

/* One sequence's share of a step: new tokens to feed (a prefill chunk or the
 * previous decode token) and whether to sample after them. Host-owned. */
typedef struct gantry_step_entry {
    uint64_t seq;
    const int32_t* tokens;
    size_t n_tokens;
    uint32_t flags;
    const gantry_sampling_t* sampling; /* required when GANTRY_STEP_SAMPLE is set */
} gantry_step_entry_t;

typedef struct gantry_token_logprob {
    int32_t token;
    float logprob;
} gantry_token_logprob_t;

/* Result for one entry, in a host-allocated array parallel to the entries (an entry with
 * GANTRY_STEP_SAMPLE_ALL takes `n_tokens` slots, see above). Written only for entries with
 * GANTRY_STEP_SAMPLE. */
typedef struct gantry_step_result {
    int32_t token;
    float logprob; /* natural log probability under the model; NaN when not wanted */
    uint32_t n_top;
    gantry_token_logprob_t top[GANTRY_MAX_TOP_LOGPROBS];
} gantry_step_result_t;

/* Since 1.12: one of a model's event counters (`model_counters`). */
typedef struct gantry_counter {
    const char* name; /* NUL-terminated, plugin-owned */
    uint64_t value;
} gantry_counter_t;

/* The function table. `struct_size` is sizeof(gantry_engine_vtable_t) as the
 * plugin was compiled; slots beyond it do not exist. */
typedef struct gantry_engine_vtable {
    uint32_t struct_size;

    /* Fill `out` (host-allocated). Infallible. */
    void (*info)(gantry_engine_info_t* out);

    /* Create an engine instance. `config` is read during the call only; `host`
     * stays valid until `destroy`. On success `*out` is a plugin-owned handle. */
    gantry_status_t (*create)(const gantry_engine_config_t* config,
                              const gantry_host_api_t* host, gantry_engine_t** out,
                              gantry_error_t* err);

    /* Release an engine. All its models have been unloaded before. */
    void (*destroy)(gantry_engine_t* engine);

    /* Load a model. On failure nothing stays allocated (no partial loads): a
     * load that does not fit returns GANTRY_OOM_VRAM or GANTRY_OOM_RAM. */
    gantry_status_t (*load_model)(gantry_engine_t* engine, const gantry_model_desc_t* desc,
                                  gantry_model_t** out, gantry_error_t* err);

    /* Fill `out` (host-allocated; plugin-owned strings inside, see above). */
    gantry_status_t (*model_info)(gantry_model_t* model, gantry_model_info_t* out,
                                  gantry_error_t* err);

    /* Tokenize `text_len` bytes of UTF-8. Writes min(*n_tokens, capacity) ids
     * to `tokens` (host-owned) and sets `*n_tokens` to the full count; the host
     * calls again with a larger buffer when the count exceeds the capacity.
     * `add_special` prepends BOS when the model wants it; `parse_special`
     * turns special-token text (e.g. "<|im_start|>") into its id. */
    gantry_status_t (*tokenize)(gantry_model_t* model, const char* text, size_t text_len,
                                bool add_special, bool parse_special, int32_t* tokens,
                                size_t capacity, size_t* n_tokens, gantry_error_t* err);

    /* Write the bytes of `n` tokens into `buf` (host-owned, `capacity` bytes).
     * Bytes may end inside a UTF-8 character; the host reassembles. Sets
     * `*len` to the full byte count; the host retries with a larger buffer
     * when it exceeds the capacity. `render_special` renders control tokens
     * as their text instead of nothing. */
    gantry_status_t (*detokenize)(gantry_model_t* model, const int32_t* tokens, size_t n,
                                  bool render_special, char* buf, size_t capacity,
                                  size_t* len, gantry_error_t* err);

    /* Open a sequence with empty KV. `*seq` is a plugin-chosen id. Fails with
     * GANTRY_OOM_VRAM when max_sequences are open. */
    gantry_status_t (*seq_open)(gantry_model_t* model, uint64_t* seq, gantry_error_t* err);

    /* Release a sequence: its KV cells and sampler state are freed at once.
     * Releasing an unknown id is a no-op. */
    void (*seq_release)(gantry_model_t* model, uint64_t seq);

    /* One forward pass over a batch: every entry's tokens are appended to its
     * sequence's KV, and for each entry with GANTRY_STEP_SAMPLE one token is
     * sampled with that entry's parameters into `results[i]`. On failure no
     * entry's KV has advanced past the failing pass; the host releases the
     * affected sequences. */
    gantry_status_t (*step)(gantry_model_t* model, const gantry_step_entry_t* entries,
                            size_t n_entries, gantry_step_result_t* results,
                            gantry_error_t* err);

    /* Embed one input. Writes min(capacity, dims) floats to `out` (host-owned)
     * and sets `*dims`. Only for models with GANTRY_MODALITY_EMBEDDING;
     * others return GANTRY_UNSUPPORTED. */
    gantry_status_t (*embed)(gantry_model_t* model, const int32_t* tokens, size_t n_tokens,
                             float* out, size_t capacity, size_t* dims, gantry_error_t* err);

    /* Free everything the model holds. The handle is invalid afterwards. */
    void (*unload_model)(gantry_model_t* model);

    /* Since 1.4; optional (a NULL slot, or a vtable whose `struct_size` does not cover it,
     * means "not reported"). How many tokens of sequence `seq`'s first entry the plugin took
     * from a cache (a released sequence's warm KV, shared prefix blocks) instead of evaluating
     * them: 0 for a sequence that reused nothing (a cold cache, GANTRY_STEP_FRESH), at most
     * that entry's `n_tokens`. Returns -1 when it does not know (an unknown sequence, or one
     * whose first entry has not been stepped). The host calls it after the step that carried
     * the sequence's first entry and before `seq_release`, so that it can count the prompt
     * tokens an engine actually evaluated. Infallible; must not block. */
    int64_t (*seq_cached_tokens)(gantry_model_t* model, uint64_t seq);

    /* Since 1.5; optional (NULL, not covered by `struct_size`, or GANTRY_UNSUPPORTED: the host
     * evaluates the prompt once per sequence instead). Open a new sequence `*out` whose KV
     * holds exactly what `src`'s holds (the same tokens at the same positions), sharing or
     * copying cells as the plugin likes; its own next entry continues after them. Sampler
     * state is not copied: the new sequence's first sample starts its own (its own `seed`).
     * `src` has been stepped and stays as it was. Fails with GANTRY_OOM_VRAM / OOM_RAM when no
     * sequence or cell is free. Used for `n` > 1: the prompt is evaluated once. */
    gantry_status_t (*seq_fork)(gantry_model_t* model, uint64_t src, uint64_t* out,
                                gantry_error_t* err);

    /* Since 1.5; required with GANTRY_CAP_SPECULATE. Keep the first `n_keep` tokens of `seq`'s
     * KV and drop the rest, with the samples taken after the dropped tokens (a penalty's
     * history forgets them); the next entry continues at position `n_keep`. `n_keep` is at
     * most the tokens the sequence holds. */
    gantry_status_t (*seq_truncate)(gantry_model_t* model, uint64_t seq, uint64_t n_keep,
                                    gantry_error_t* err);

    /* Since 1.6; required with GANTRY_CAP_ADAPTERS. Load a LoRA adapter for `model`: `*out` is
     * a nonzero plugin-chosen id, `*bytes` the memory it holds. An adapter that does not fit
     * the model (another architecture, a tensor whose shape disagrees with the base's, a
     * target the model lacks, a rank of 0) is refused with GANTRY_LOAD_FAILED and a message
     * naming the tensor and both shapes; an unreadable file with GANTRY_MODEL_CORRUPT; one
     * that does not fit in memory with GANTRY_OOM_VRAM / OOM_RAM. A refusal leaves nothing
     * allocated and the model serving as before. */
    gantry_status_t (*adapter_load)(gantry_model_t* model, const gantry_adapter_desc_t* desc,
                                    uint64_t* out, uint64_t* bytes, gantry_error_t* err);

    /* Since 1.6; required with GANTRY_CAP_ADAPTERS. Free an adapter. No open sequence uses it
     * (the host releases them first). Unloading an unknown id is a no-op. */
    void (*adapter_unload)(gantry_model_t* model, uint64_t adapter);

    /* Since 1.6; required with GANTRY_CAP_ADAPTERS. Run sequence `seq` with `adapter` (a
     * loaded adapter's id; 0 = none, the base model). The host calls it after `seq_open` and
     * before the sequence's first step; a forked sequence inherits its source's adapter.
     * Entries of one step may name different adapters. KV computed under one adapter is
     * never reused for a sequence under another (a warm prefix is keyed by the adapter). */
    gantry_status_t (*seq_set_adapter)(gantry_model_t* model, uint64_t seq, uint64_t adapter,
                                       gantry_error_t* err);

    /* Since 1.8; optional (NULL, or a vtable whose `struct_size` does not cover it: the host
     * calls `embed` once per input). Embed `n_inputs` inputs in one call, as `embed` embeds
     * one: input i is the `lengths[i]` tokens that follow input i - 1's in `tokens`. Writes
     * input i's vector at `out + i * dims`, at most `capacity` floats in all, and sets
     * `*dims` to one vector's size; when `n_inputs * dims` exceeds `capacity` it writes
     * nothing and the host calls again with room for all. An input the model cannot embed
     * (empty, too long, a token outside the vocabulary) fails the whole call with the input's
     * index in the message; nothing is kept between calls. Only for models with
     * GANTRY_MODALITY_EMBEDDING. Lets an engine run the inputs as one batch (one pass over
     * the weights for all of them) instead of one pass each. */
    gantry_status_t (*embed_batch)(gantry_model_t* model, const int32_t* tokens,
                                   const size_t* lengths, size_t n_inputs, float* out,
                                   size_t capacity, size_t* dims, gantry_error_t* err);

    /* Since 1.9; required with GANTRY_MODALITY_TRANSCRIPTION (and VISION). Condition sequence
     * `seq` on `input`: for audio, the model's encoder runs now and every later step of the
     * sequence attends to what it computed (Whisper's cross-attention). The host calls it
     * after `seq_open` and before the sequence's first step; a forked sequence shares its
     * source's input. The text the sequence decodes starts with the model's own prompt tokens
     * (Whisper: `<|startoftranscript|>`, a language, a task), which the host feeds with
     * `step`. An input of a kind the model does not take, at another sample rate, empty, or
     * longer than `audio_max_samples` is refused with GANTRY_UNSUPPORTED naming the limit; the
     * sequence then stays open without an input. */
    gantry_status_t (*seq_set_input)(gantry_model_t* model, uint64_t seq,
                                     const gantry_input_t* input, gantry_error_t* err);

    /* Since 1.10; required with GANTRY_MODALITY_SPEECH. Start synthesizing `req`: the text is
     * checked and cut into pieces now (sentences, for most voices), and `*speech` receives a
     * nonzero handle. An unknown voice or text the model cannot speak is refused with
     * GANTRY_UNSUPPORTED naming it. Nothing is synthesized yet. */
    gantry_status_t (*speech_open)(gantry_model_t* model, const gantry_speech_request_t* req,
                                   uint64_t* speech, gantry_error_t* err);
    /* Since 1.10; required with GANTRY_MODALITY_SPEECH. Synthesize the next piece of
     * `speech`: `*samples` and `*n` receive mono f32 PCM in [-1, 1] at the model's
     * `audio_sample_rate`, plugin-owned and valid until the next call for this handle;
     * `*done` is true with the last piece (which may be empty). The host calls it between
     * steps, one piece at a time, so each call is bounded by one piece's work and several
     * syntheses interleave. */
    gantry_status_t (*speech_next)(gantry_model_t* model, uint64_t speech, const float** samples,
                                   size_t* n, bool* done, gantry_error_t* err);
    /* Since 1.10; required with GANTRY_MODALITY_SPEECH. Free `speech`, finished or not. */
    void (*speech_close)(gantry_model_t* model, uint64_t speech);

    /* Since 1.11; optional. For a sequence whose input was set with GANTRY_INPUT_ALIGN: when
     * in its input each token fed to it is spoken, for the tokens fed from position `first`
     * (counted from the first token fed after the input) on, in seconds from the start of the
     * input's audio. The time of a token is where the model's attention was while it
     * predicted the next one, so a word's time is the time of the token before it (Whisper:
     * its alignment heads' cross-attention, normalised per head over the tokens,
     * median-filtered and aligned with the audio by dynamic time warping). Writes
     * min(*n, capacity) times to `times` (host-owned) and sets `*n` to the full count. */
    gantry_status_t (*seq_token_times)(gantry_model_t* model, uint64_t seq, size_t first,
                                       float* times, size_t capacity, size_t* n,
                                       gantry_error_t* err);

    /* Since 1.11; optional. `*prob` receives the probability of `token` coming right after the
     * first `n_fed` tokens fed to `seq` since its input, under the model's own distribution
     * there: the softmax of the raw logits, before any bias, mask, penalty, temperature or
     * decoding rule (Whisper's no-speech probability is that of `<|nospeech|>` after
     * `<|startoftranscript|>`). `n_fed` is at least 1 and at most the tokens fed. */
    gantry_status_t (*seq_token_prob)(gantry_model_t* model, uint64_t seq, size_t n_fed,
                                      int32_t token, float* prob, gantry_error_t* err);

    /* Since 1.12; optional. The model's event counters, each cumulative since the model was
     * loaded and never decreasing: `*counters` and `*n` receive an array, plugin-owned and
     * valid until the next `model_counters` call on this model. Names are short snake_case
     * words (`graph_builds`, `graph_reuses`, ...) that the host reports as
     * `gantry_engine_events_total{event=...}`; the set may differ between calls, and a name
     * absent from a call keeps its last value. The host calls it from the thread that runs
     * the model's steps, between steps, about once a second. */
    gantry_status_t (*model_counters)(gantry_model_t* model, const gantry_counter_t** counters,
                                      size_t* n, gantry_error_t* err);
} gantry_engine_vtable_t;

/* What the entry symbol returns; static, owned by the plugin. */
typedef struct gantry_engine_entry {
    uint32_t abi_major;
    uint32_t abi_minor;
    uint32_t struct_size; /* sizeof(gantry_engine_entry_t) */
    const gantry_engine_vtable_t* vtable;
} gantry_engine_entry_t;

/* The one exported symbol. Must not allocate, block or fail. */
typedef const gantry_engine_entry_t* (*gantry_engine_entry_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* GANTRY_ENGINE_H */
