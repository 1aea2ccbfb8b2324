"""Stands in for Hugging Face `datasets` in the GPU check's torchtitan_llama1b step, and only where the
real package is not installed (bench/gpu_check.sh puts this directory on the step's path then).

torchtitan 0.3.0 imports `datasets` whenever its trainer is imported (torchtitan/trainer.py ->
components/validate.py -> hf_datasets/text_datasets.py: `Dataset`, `load_dataset`,
`datasets.distributed.split_dataset_by_node`) but a synthetic-token run never calls them. The real
package pulls in pyarrow and pandas, about 70 MB of wheels: over the 64 MiB that travels to the GPU
machine. Anything that does use these names fails loudly.
"""

STAND_IN = True  # bench/gpu_check/titan_check.py reports that the stand-in was used


class Dataset:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("datasets is not installed: this is the GPU check's stand-in "
                           "(bench/gpu_check/no_datasets); a synthetic-token run needs no dataset")


def load_dataset(*args, **kwargs):
    raise RuntimeError("datasets is not installed: this is the GPU check's stand-in "
                       "(bench/gpu_check/no_datasets); a synthetic-token run needs no dataset")
