# Type hints of the extension module qkv._dist (bindings/python/src/dist), which qkv.dist wraps: its
# functions take every keyword argument of qkv.dist's, always given (see qkv/dist.py).
from typing import Any, List, Tuple, Union

import numpy as np
import numpy.typing as npt

def ring_attention(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike,
                   **kwargs: Any) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]: ...
def ring_attention_backward(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, dout: npt.ArrayLike,
                            **kwargs: Any) -> Tuple[np.ndarray, ...]: ...
def shard_ranges(tokens: int, ranks: int, rank: int, layout: str = ...) -> List[Tuple[int, int]]: ...
