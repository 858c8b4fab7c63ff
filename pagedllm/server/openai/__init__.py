"""OpenAI's API on the request and response side: the chat and completion request shapes,
their constraint and tool fields, the chat template, logprobs, tool calls read into
`tool_calls`, /tokenize and /detokenize, and the pooling routes (embeddings, score, rerank).
The Responses and Messages rooms build on these pieces: each of their requests is served as a
chat completion request."""
