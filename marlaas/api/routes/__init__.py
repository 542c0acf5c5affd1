"""The API's routers, one module per resource; `marlaas.api.app.create_app` includes them."""
