"""benchmarks/activation_memory.py: what a training step keeps for its backward, counted on the meta device."""

from benchmarks import activation_memory, saved_activations

GB = 1e9


def test_attention_is_counted_as_a_fused_kernel_keeps_it():
    """PixArt-Sigma at 1024px reads 4x the tokens of 512px: 4x the saved activations with a fused kernel's
    q, k, v and output (the math kernel's attention matrices would make it about 10x)."""
    small, large = (saved_activations.saved_bytes_per_image('pixart-sigma', size) for size in (512, 1024))
    assert 3.5 < large / small < 4.5


def test_weights_are_not_counted_and_sd2_fits_the_published_microbatch():
    # Flux's transformer holds 23.8 GB of bf16 weights, which every matmul saves a view of: none of it counts.
    assert saved_activations.saved_bytes_per_image('flux-schnell', 256) < 10 * GB
    # The published run fit 4 images of 512px on an A100-40GB beside 15 GB of training state.
    sd2 = saved_activations.saved_bytes_per_image('sd2-base', 512)
    assert 0.25 * GB < sd2 and 15 * GB + 4 * sd2 < 40 * GB


def test_the_table_has_a_row_per_model_and_size(capsys):
    rows = activation_memory.main(['--model_name', 'tiny', 'tiny-flux-schnell', '--image_size', '32', '64'])
    assert [(row['model_name'], row['image_size']) for row in rows] == [
        ('tiny', 32),
        ('tiny', 64),
        ('tiny-flux-schnell', 32),
        ('tiny-flux-schnell', 64),
    ]
    assert all(row['bytes'] > 0 for row in rows) and rows[1]['bytes'] > rows[0]['bytes']
    assert '| `tiny-flux-schnell` | 64px |' in capsys.readouterr().out
