"""outlierscope: activation outliers and low-bit attention quantization of transformer LMs.

Reference: Ye et al., Differential Transformer (arXiv 2410.05258), Table 5 and Figure 8.
"""

__version__ = "0.1.0"
