-- Cache key and route for an mm-encoder cache tier or router (access phase).
--
-- key   = sha256 of the request body, computed here from memory or, when nginx spooled the body to
--         a file, from that file: an entry is keyed by what was asked, never by what a caller says
--         it asked, so no caller can store one request's answer under another's key. A caller's
--         X-Cache-Key (the frontend's and the engines', `EncodeRequest.key`: the sha256 of the
--         canonical body they send) is checked against it: 400 `bad_cache_key` when it differs.
--         The router stores nothing: it routes by a caller's key as given (the shard it picks
--         checks it) and hashes only a body that comes without one.
--         sha256 rather than md5: tiers are shared across tenants, and md5 collisions can be
--         made to order (two uploads, one hash), which would let one upload poison another's entry.
-- format: "json" when the client accepts only the legacy JSON form, else "v1": part of the
--         cache key, so one entry never answers for the other representation.
-- route : X-Cache-Route (e.g. "cluster,shared", "cluster,direct") names the levels to visit.
--         A tier caches only if it is named; it forwards to its next level if a later level is
--         named, else straight to the encoders.
-- Inputs (nginx variables set by the config): $mm_tier, $mm_drop_client_key (ignore a caller's key
-- instead of checking it).
-- Outputs: $cache_key, $cache_fmt, $cache_skip, $mm_upstream; X-Cache-Key is forwarded (the next
-- level checks it again).

local tier = ngx.var.mm_tier

local function refuse(message)
    ngx.status = 400
    ngx.header["Content-Type"] = "application/json"
    ngx.header["X-MM-Error-Code"] = "bad_cache_key"
    ngx.header["X-MM-Error"] = message  -- a HEAD answer has no body
    ngx.say('{"error": {"code": "bad_cache_key", "message": "', message, '"}}')
    return ngx.exit(400)
end

local function body_sha256()
    ngx.req.read_body()
    local sha = require("nginx.sha256"):new()
    local data = ngx.req.get_body_data()
    if data then
        sha:update(data)
    else
        local path = ngx.req.get_body_file()
        if path then
            local f, err = io.open(path, "rb")
            if not f then
                ngx.log(ngx.ERR, "cannot read spooled request body ", path, ": ", err)
                return ngx.exit(500)
            end
            while true do
                local chunk = f:read(1048576)
                if not chunk then break end
                sha:update(chunk)
            end
            f:close()
        end
    end
    return require("nginx.string").to_hex(sha:final())
end

local claimed = ngx.var.http_x_cache_key
if ngx.var.mm_drop_client_key == "1" or claimed == "" then
    claimed = nil
end
if claimed ~= nil and (#claimed > 128 or not claimed:match("^[%w%._:%-]+$")) then
    return refuse("X-Cache-Key must be 1-128 characters of [A-Za-z0-9._:-]")
end

local key
if tier == "router" and claimed ~= nil then
    key = claimed
else
    key = body_sha256()
    if claimed ~= nil and claimed ~= key then
        return refuse("X-Cache-Key is not the sha256 of this request body: a tier keys an entry by its body "
                      .. "(send the body as EncodeRequest.body writes it, or no key)")
    end
end
ngx.var.cache_key = key
ngx.req.set_header("X-Cache-Key", key)

local accept = ngx.var.http_accept or ""
if accept:find("application/json", 1, true) and not accept:find("vnd.mm-encoder", 1, true) then
    ngx.var.cache_fmt = "json"
else
    ngx.var.cache_fmt = "v1"
end

if tier == "router" then
    return
end
local order = { cluster = 1, shared = 2 }
local route = ngx.var.http_x_cache_route
local named, later = true, (tier == "cluster")
if route ~= nil and route ~= "" then
    named, later = false, false
    for level in route:gmatch("[^,%s]+") do
        level = level:lower()
        if level == tier then
            named = true
        elseif order[level] ~= nil and order[level] > order[tier] then
            later = true
        end
    end
end
ngx.var.cache_skip = named and "" or "1"
ngx.var.mm_upstream = later and "mm_next" or ngx.var.mm_model_pool  -- the encoders: of the request's model
