"""The statistics the toolkit computes, streamed and mergeable: reducers (top-k, histograms, moments), OutlierStats
(Table 5 and finer), the attention error of quantized logits, paired tests."""
