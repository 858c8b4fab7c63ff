"""OpenAI's Responses API (/v1/responses): its request shapes, the chat request each becomes,
the Response objects and events made from the chat answer, and the per-tenant store behind
`previous_response_id`."""
