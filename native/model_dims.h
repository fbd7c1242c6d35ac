// model_dims.h: shapes derived from the qwen35 hyperparameters (oj_hparams), named as
// openjet_plugin/config.py names them. Only derivations live here; the numbers come from the file.
#pragma once

#include "openjet.h"

namespace oj {

struct ModelDims {
    oj_hparams hp;

    int q_dim() const { return hp.n_head * hp.head_dim; }
    int kv_dim() const { return hp.n_head_kv * hp.head_dim; }
    int ssm_key_dim() const { return hp.ssm_d_state * hp.ssm_n_group; }
    int ssm_value_dim() const { return hp.ssm_d_state * hp.ssm_dt_rank; }
    // channels of the causal conv: q and k (key_dim each), then v (value_dim)
    int ssm_conv_dim() const { return 2 * ssm_key_dim() + ssm_value_dim(); }
    int block_count() const { return hp.n_layer + hp.n_layer_nextn; }
    // llama.cpp's rule: layer il is Gated DeltaNet unless (il + 1) is a multiple of the interval
    bool is_recurrent(int il) const {
        return il < hp.n_layer && (il + 1) % hp.full_attention_interval != 0;
    }
};

}  // namespace oj
