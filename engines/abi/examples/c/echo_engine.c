/*
 * echo_engine.c — a complete Gantry engine plugin in plain C99.
 *
 * A toy: tokens are bytes, and `step` samples "the previous token plus one".
 * It exists to show every ownership rule of gantry_engine.h in working code;
 * the engine host tests build it with `cc -shared -fPIC` and load it.
 *
 *   cc -std=c99 -shared -fPIC -I engines/abi/include echo_engine.c -o libecho_engine.so
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gantry_engine.h"

#define MAX_SEQS 16

struct gantry_engine {
    gantry_host_api_t host; /* copied: the host keeps the pointer valid until destroy */
    uint32_t max_seqs;
};

struct gantry_model {
    struct gantry_engine* engine;
    int32_t last[MAX_SEQS]; /* last token per sequence slot */
    bool open[MAX_SEQS];
    const char* arch; /* static string: lives until unload (forever) */
};

static void set_err(gantry_error_t* err, const char* msg) {
    snprintf(err->message, GANTRY_ERROR_MESSAGE_MAX, "%s", msg);
}

static void echo_info(gantry_engine_info_t* out) {
    out->struct_size = sizeof(*out);
    out->engine_id = "echo"; /* static: lives until the library is unloaded */
    out->engine_version = "1.0.0";
    out->backend = GANTRY_BACKEND_CPU;
    out->description = "byte echo engine written in C";
}

static gantry_status_t echo_create(const gantry_engine_config_t* cfg, const gantry_host_api_t* host,
                                   gantry_engine_t** out, gantry_error_t* err) {
    struct gantry_engine* e = calloc(1, sizeof(*e));
    if (!e) { set_err(err, "out of memory"); return GANTRY_OOM_RAM; }
    if (host) e->host = *host;
    e->max_seqs = cfg->max_batch_size < MAX_SEQS ? cfg->max_batch_size : MAX_SEQS;
    if (e->host.log) e->host.log(e->host.ctx, GANTRY_LOG_INFO, "echo engine created");
    *out = e;
    return GANTRY_OK;
}

static void echo_destroy(gantry_engine_t* e) { free(e); }

static gantry_status_t echo_load(gantry_engine_t* e, const gantry_model_desc_t* d, gantry_model_t** out,
                                 gantry_error_t* err) {
    if (d->format != GANTRY_FORMAT_GGUF) { set_err(err, "echo loads gguf only"); return GANTRY_UNSUPPORTED; }
    struct gantry_model* m = calloc(1, sizeof(*m));
    if (!m) { set_err(err, "out of memory"); return GANTRY_OOM_RAM; }
    m->engine = e;
    m->arch = "toy";
    *out = m;
    return GANTRY_OK;
}

static gantry_status_t echo_model_info(gantry_model_t* m, gantry_model_info_t* out, gantry_error_t* err) {
    (void)err;
    memset(out, 0, sizeof(*out));
    out->struct_size = sizeof(*out);
    out->architecture = m->arch;
    out->vocab_size = 256;
    out->context_length = 256;
    out->trained_context_length = 256;
    out->kv_capacity_tokens = 256u * m->engine->max_seqs;
    out->max_sequences = m->engine->max_seqs;
    out->bos_token = -1;
    out->eos_token = -1;
    out->modalities = GANTRY_MODALITY_COMPLETION;
    return GANTRY_OK;
}

static gantry_status_t echo_tokenize(gantry_model_t* m, const char* text, size_t len, bool add_special,
                                     bool parse_special, int32_t* tokens, size_t cap, size_t* n,
                                     gantry_error_t* err) {
    (void)m; (void)add_special; (void)parse_special; (void)err;
    for (size_t i = 0; i < len && i < cap; i++) tokens[i] = (unsigned char)text[i];
    *n = len; /* the full count, even when it exceeds `cap` */
    return GANTRY_OK;
}

static gantry_status_t echo_detokenize(gantry_model_t* m, const int32_t* tokens, size_t n, bool special,
                                       char* buf, size_t cap, size_t* len, gantry_error_t* err) {
    (void)m; (void)special; (void)err;
    for (size_t i = 0; i < n && i < cap; i++) buf[i] = (char)(tokens[i] & 0xff);
    *len = n;
    return GANTRY_OK;
}

static gantry_status_t echo_seq_open(gantry_model_t* m, uint64_t* seq, gantry_error_t* err) {
    for (uint32_t i = 0; i < m->engine->max_seqs; i++) {
        if (!m->open[i]) { m->open[i] = true; m->last[i] = 0; *seq = i; return GANTRY_OK; }
    }
    set_err(err, "all sequence slots are in use");
    return GANTRY_OOM_VRAM;
}

static void echo_seq_release(gantry_model_t* m, uint64_t seq) {
    if (seq < MAX_SEQS) m->open[seq] = false;
}

static gantry_status_t echo_step(gantry_model_t* m, const gantry_step_entry_t* entries, size_t n,
                                 gantry_step_result_t* results, gantry_error_t* err) {
    for (size_t i = 0; i < n; i++) {
        uint64_t s = entries[i].seq;
        if (s >= MAX_SEQS || !m->open[s]) { set_err(err, "unknown sequence"); return GANTRY_INTERNAL; }
        if (entries[i].n_tokens > 0) m->last[s] = entries[i].tokens[entries[i].n_tokens - 1];
        if (entries[i].flags & GANTRY_STEP_SAMPLE) {
            results[i].token = (m->last[s] + 1) % 256;
            results[i].logprob = 0.0f;
            results[i].n_top = 0;
        }
    }
    return GANTRY_OK;
}

static gantry_status_t echo_embed(gantry_model_t* m, const int32_t* t, size_t n, float* out, size_t cap,
                                  size_t* dims, gantry_error_t* err) {
    (void)m; (void)t; (void)n; (void)out; (void)cap; (void)dims;
    set_err(err, "echo has no embeddings");
    return GANTRY_UNSUPPORTED;
}

static void echo_unload(gantry_model_t* m) { free(m); }

/* Since ABI 1.4: echo keeps no cache, so an open sequence took nothing from one. */
static int64_t echo_seq_cached_tokens(gantry_model_t* m, uint64_t seq) {
    return (seq < MAX_SEQS && m->open[seq]) ? 0 : -1;
}

static const gantry_engine_vtable_t VTABLE = {
    sizeof(gantry_engine_vtable_t), echo_info, echo_create, echo_destroy, echo_load, echo_model_info,
    echo_tokenize, echo_detokenize, echo_seq_open, echo_seq_release, echo_step, echo_embed, echo_unload,
    echo_seq_cached_tokens,
};

static const gantry_engine_entry_t ENTRY = {
    GANTRY_ABI_MAJOR, GANTRY_ABI_MINOR, sizeof(gantry_engine_entry_t), &VTABLE,
};

const gantry_engine_entry_t* gantry_engine_entry(void) { return &ENTRY; }
