"""The API's routers, one module per resource; `marlaas.api.app.create_app` includes them.

`{name:rest}` is a path parameter that takes the rest of the path, newlines included: Starlette's
`{name:path}` is `.*`, which stops at a newline (`%0A`), so such a path missed its route and met the
generic 404 instead of the route's own answer (an OpenAI-shaped 404 for `/v1/models/{model}`)."""

from starlette.convertors import PathConvertor, register_url_convertor


class RestConvertor(PathConvertor):
    regex = "[\\s\\S]*"


register_url_convertor("rest", RestConvertor())
